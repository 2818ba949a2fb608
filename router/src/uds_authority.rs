//! The UNIX socket's connections (`--grpc_socket_path`) with each call's `:authority` made one
//! the front door's HTTP/2 takes.
//!
//! gRPC's C core (Python, C++ clients) names a `unix:` target's percent-encoded path as the
//! `:authority` of its calls (`%2Frun%2Ftfs.sock`), and h2 resets every stream whose authority
//! is not a URI authority (hyperium/h2#487), while TF Serving's gRPC server takes it. So on
//! this listener a connection's first header block is decoded (HPACK, with the client's
//! encoding state). If its authority is valid (grpc-go, tonic, a client that sets
//! `grpc.default_authority`), the block and everything after it pass as they came: the
//! connection costs nothing more. If not, the connection is rewritten: each header block is
//! decoded, an authority that is not a valid one becomes `localhost` (what grpc-go and tonic
//! send on a UNIX socket), and the block is encoded again for h2 without HPACK's dynamic
//! table, so h2's decoder has no state of this connection's to follow (`hpack.rs` does both);
//! a gRPC channel names one authority for all its calls. Every other frame passes as it came;
//! what the front door writes is not touched. Where a block breaks HTTP/2's framing or limits
//! (another frame inside it, too many CONTINUATIONs, a header list h2 ends a connection for),
//! h2 is handed frames that make it send the GOAWAY it sends for the same on the TCP port,
//! and nothing after. The TCP port never goes through here.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::hpack;

const PREFACE_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The frames written to h2 stay within the SETTINGS_MAX_FRAME_SIZE the front door advertises.
const MAX_FRAME: usize = crate::server::MAX_FRAME as usize;
/// A header block this long is not a gRPC call's: the connection is ended. HPACK writes no
/// field in fewer bytes than 8/30 of what it counts (Huffman's longest code is 30 bits), so a
/// longer block decodes past MAX_LIST, where h2 ends the connection anyway. (It was 1 MiB: a
/// stalled block held its bytes twice, about 4.4 MiB a connection; found by a hunt.)
const MAX_BLOCK: usize = 4 * MAX_LIST;
/// Nor is a header list this large once decoded (each field's name and value plus 32, as
/// HTTP/2 counts them): h2 ends the connection of a list over 4 times its limit (h2's
/// MAX_HEADER_LIST_ABUSE_MULTIPLIER), as it does on the TCP port, and refuses only the call
/// (431, REFUSED_STREAM) of one between. Bounded while decoding, since a small block of
/// references to one large table entry decodes to gigabytes.
const MAX_LIST: usize = 4 * crate::server::MAX_HEADER_LIST as usize;
/// HPACK's default dynamic table size, the most h2 lets a client's encoder use.
const TABLE_SIZE: usize = 4096;
const LOCALHOST: &[u8] = b"localhost";
/// The CONTINUATION frames without END_HEADERS h2 takes in one block before it ends the
/// connection (GOAWAY ENHANCE_YOUR_CALM, "too_many_continuations"): its own count, from the
/// front door's header list and frame limits (h2's calc_max_continuation_frames).
const MAX_CONTINUATIONS: usize = {
    let frames = crate::server::MAX_HEADER_LIST / crate::server::MAX_FRAME;
    let frames = if frames < 1 { 1 } else { frames } as usize;
    let padded = frames + (frames >> 2);
    if padded < 5 {
        5
    } else {
        padded
    }
};
const PING: u8 = 0x6;

enum Reading {
    Preface,
    Frames,
    /// The rest of a frame that passes as it is: this many bytes.
    Passing(usize),
}

/// A header block being gathered from HEADERS and CONTINUATION frames.
struct Block {
    stream: [u8; 4],
    /// CONTINUATION frames so far without END_HEADERS.
    continuations: usize,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    bytes: Vec<u8>,
    /// Its frames as they came, while the connection's first block decides (`deciding`).
    frames: Vec<u8>,
}

pub struct AuthorityFix<S> {
    inner: S,
    /// Off: every byte passes as it is (the TCP port's connections, and a connection whose
    /// first block's authority was valid, once `output` is drained).
    fixing: bool,
    /// Until the connection's first header block has been read.
    deciding: bool,
    /// What reads from `inner` land in (allocated once, not zeroed each time).
    scratch: Vec<u8>,
    reading: Reading,
    /// Read from the client, not handled yet.
    input: BytesMut,
    /// Ready for h2.
    output: BytesMut,
    block: Option<Block>,
    /// h2 has been handed frames it ends the connection for (a header list past MAX_LIST,
    /// broken framing): nothing after them passes (`stop_after`).
    spent: bool,
    decoder: hpack::Decoder,
    /// A block encoded again for h2 (kept between blocks, not allocated for each).
    encoded: Vec<u8>,
    ended: bool,
}

impl<S> AuthorityFix<S> {
    /// `inner`'s calls, their authorities fixed when `fixing` (after any TLS: the frames are
    /// the decrypted ones).
    pub fn new(inner: S, fixing: bool) -> AuthorityFix<S> {
        AuthorityFix {
            inner,
            fixing,
            deciding: true,
            scratch: if fixing {
                vec![0; 16 << 10]
            } else {
                Vec::new()
            },
            reading: Reading::Preface,
            input: BytesMut::with_capacity(16 << 10),
            output: BytesMut::with_capacity(16 << 10),
            block: None,
            spent: false,
            decoder: hpack::Decoder::new(TABLE_SIZE),
            encoded: Vec::new(),
            ended: false,
        }
    }

    /// Moves what `input` holds, as far as it is whole, to `output`.
    fn handle(&mut self) -> io::Result<()> {
        loop {
            if self.spent {
                self.input.clear();
                return Ok(());
            }
            match self.reading {
                Reading::Preface => {
                    if self.input.len() < PREFACE_LEN {
                        return Ok(());
                    }
                    self.output.put(self.input.split_to(PREFACE_LEN));
                    self.reading = Reading::Frames;
                }
                Reading::Passing(left) => {
                    let n = left.min(self.input.len());
                    self.output.put(self.input.split_to(n));
                    if n < left {
                        self.reading = Reading::Passing(left - n);
                        return Ok(());
                    }
                    self.reading = Reading::Frames;
                }
                Reading::Frames => {
                    if self.input.len() < FRAME_HEADER_LEN {
                        return Ok(());
                    }
                    let head = &self.input[..FRAME_HEADER_LEN];
                    let len = usize::from(head[0]) << 16
                        | usize::from(head[1]) << 8
                        | usize::from(head[2]);
                    let kind = head[3];
                    if len > MAX_FRAME {
                        // h2 refuses it from its head alone (FRAME_SIZE_ERROR), before it
                        // looks at what kind it is: inside a header block too.
                        self.output.put(self.input.split_to(FRAME_HEADER_LEN));
                        self.stop_after();
                        continue;
                    }
                    if kind != CONTINUATION && self.block.is_some() {
                        // HTTP/2 allows only CONTINUATIONs inside a header block.
                        let mut ping = frame_head(8, PING, 0, [0; 4]).to_vec();
                        ping.extend_from_slice(&[0; 8]);
                        self.framing_error(&ping);
                        continue;
                    }
                    if kind != HEADERS && kind != CONTINUATION {
                        self.output.put(self.input.split_to(FRAME_HEADER_LEN));
                        self.reading = Reading::Passing(len);
                        continue;
                    }
                    if self.input.len() < FRAME_HEADER_LEN + len {
                        return Ok(());
                    }
                    let frame = self.input.split_to(FRAME_HEADER_LEN + len);
                    self.header_frame(&frame)?;
                    if !self.fixing {
                        // The first block's authority was valid: the rest as it comes.
                        self.output.put(self.input.split());
                        return Ok(());
                    }
                }
            }
        }
    }

    fn header_frame(&mut self, frame: &[u8]) -> io::Result<()> {
        let (kind, flags) = (frame[3], frame[4]);
        let stream = [frame[5], frame[6], frame[7], frame[8]];
        let mut payload = &frame[FRAME_HEADER_LEN..];
        if kind == HEADERS {
            if flags & PADDED != 0 {
                let keep = payload.split_first().and_then(|(&pad, rest)| {
                    let keep = rest.len().checked_sub(usize::from(pad))?;
                    Some(&rest[..keep])
                });
                let Some(kept) = keep else {
                    // No pad length, or more padding than frame.
                    self.malformed(frame);
                    return Ok(());
                };
                payload = kept;
            }
            let mut priority = None;
            if flags & PRIORITY != 0 {
                if payload.len() < 5 {
                    self.malformed(frame);
                    return Ok(());
                }
                let mut fields = [0u8; 5];
                fields.copy_from_slice(&payload[..5]);
                priority = Some(fields);
                payload = &payload[5..];
            }
            self.block = Some(Block {
                stream,
                continuations: 0,
                end_stream: flags & END_STREAM != 0,
                priority,
                bytes: payload.to_vec(),
                frames: if self.deciding {
                    frame.to_vec()
                } else {
                    Vec::new()
                },
            });
        } else {
            let Some(block) = self.block.as_mut() else {
                // h2 says what is wrong with a CONTINUATION that continues nothing.
                self.output.put(frame);
                return Ok(());
            };
            if stream != block.stream {
                self.framing_error(frame); // h2: PROTOCOL_ERROR
                return Ok(());
            }
            if flags & END_HEADERS == 0 {
                block.continuations += 1;
                if block.continuations > MAX_CONTINUATIONS {
                    let empty = frame_head(0, CONTINUATION, 0, stream);
                    self.framing_error(&empty.repeat(MAX_CONTINUATIONS + 1));
                    return Ok(());
                }
            }
            if block.bytes.len() + payload.len() > MAX_BLOCK {
                return Err(invalid("a header block over 256 KiB"));
            }
            block.bytes.extend_from_slice(payload);
            if self.deciding {
                block.frames.extend_from_slice(frame);
            }
        }
        if flags & END_HEADERS != 0 {
            if let Some(block) = self.block.take() {
                self.write_block(block)?;
            }
        }
        Ok(())
    }

    /// The block decoded, its authority made valid, encoded again, and written as one HEADERS
    /// frame.
    fn write_block(&mut self, block: Block) -> io::Result<()> {
        let mut size = 0usize;
        let mut replaced = false;
        let encoded = &mut self.encoded;
        encoded.clear();
        let decoded = self
            .decoder
            .decode(&block.bytes, |field: hpack::Field<'_>| {
                size = size.saturating_add(field.name.len() + field.value.len() + 32);
                if size > MAX_LIST {
                    return Err(hpack::HpackError("a header list over 64 KiB"));
                }
                if field.name == b":authority"
                    && http::uri::Authority::try_from(field.value).is_err()
                {
                    replaced = true;
                    hpack::encode_plain(
                        &hpack::Field {
                            value: LOCALHOST,
                            ..field
                        },
                        encoded,
                    );
                } else {
                    hpack::encode_plain(&field, encoded);
                }
                Ok(())
            });
        match decoded {
            Ok(()) => {}
            Err(_) if size > MAX_LIST => {
                // h2 ends the connection of such a list with a GOAWAY saying why
                // (ENHANCE_YOUR_CALM, "header_list_way_too_large"), as on the TCP port: it
                // is handed one field that large, and nothing after.
                self.encoded.clear();
                let value = vec![b'-'; MAX_LIST];
                let field = hpack::Field {
                    name: b"x-header-list-over-limit",
                    value: &value,
                    sensitive: false,
                };
                hpack::encode_plain(&field, &mut self.encoded);
                self.stop_after();
            }
            Err(error) => {
                return Err(invalid(&format!(
                    "a header block HPACK cannot read: {error}"
                )))
            }
        }
        if std::mem::take(&mut self.deciding) && !replaced {
            // h2 reads this connection as the client wrote it, from its first block on.
            self.output.put_slice(&block.frames);
            self.fixing = false;
            return Ok(());
        }
        // One frame holds it: a field is encoded in no more than the 32 bytes it is counted
        // over its name and value (hpack::encode_plain), so the block is within MAX_LIST, or
        // is the one field just past it.
        const _: () = assert!(MAX_LIST + 64 <= MAX_FRAME);
        let mut flags = END_HEADERS;
        if block.end_stream {
            flags |= END_STREAM;
        }
        if block.priority.is_some() {
            flags |= PRIORITY;
        }
        let len = self.encoded.len() + block.priority.map_or(0, |p| p.len());
        self.output
            .put_slice(&frame_head(len, HEADERS, flags, block.stream));
        if let Some(priority) = block.priority {
            self.output.put_slice(&priority);
        }
        self.output.put_slice(&self.encoded);
        Ok(())
    }
}

/// A frame's 9-byte head.
fn frame_head(len: usize, kind: u8, flags: u8, stream: [u8; 4]) -> [u8; FRAME_HEADER_LEN] {
    let len = u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes();
    let mut head = [0; FRAME_HEADER_LEN];
    head[..3].copy_from_slice(&len[1..]);
    head[3] = kind;
    head[4] = flags;
    head[5..].copy_from_slice(&stream);
    head
}

impl<S> AuthorityFix<S> {
    /// A HEADERS frame h2 cannot read (its padding or priority): handed to h2 as it came, which
    /// ends the connection with its GOAWAY before it decodes anything; nothing after passes.
    fn malformed(&mut self, frame: &[u8]) {
        self.block = None;
        self.output.put_slice(frame);
        self.stop_after();
    }

    /// The client broke HTTP/2's framing inside a header block (another frame in it, a
    /// CONTINUATION of another stream, too many CONTINUATIONs). h2 is handed the block's
    /// HEADERS frame, empty and without END_HEADERS, and then `then`, so that it ends the
    /// connection with the GOAWAY it sends for the same frames on the TCP port (it checks
    /// framing before it decodes a block); nothing after passes. (The block's priority is
    /// left out: h2 would reset a stream that names itself as its dependency and keep the
    /// connection, which the rewrite cannot follow, having dropped the block.)
    fn framing_error(&mut self, then: &[u8]) {
        let stream = self.block.take().map_or([0; 4], |block| block.stream);
        self.output.put_slice(&frame_head(0, HEADERS, 0, stream));
        self.output.put_slice(then);
        self.stop_after();
    }

    /// What h2 has been handed ends the connection: nothing after it passes, and reads end
    /// once it is taken (the decoder no longer follows the client's table).
    fn stop_after(&mut self) {
        self.spent = true;
        self.deciding = false;
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.fixing && this.output.is_empty() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output[..n]);
                this.output.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.spent {
                return Poll::Ready(Ok(())); // h2 ends the connection on what it was handed
            }
            if this.ended {
                // What is left is not whole: h2 sees it as it came, then the end.
                let rest = this.input.split();
                if rest.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                this.output.put(rest);
                continue;
            }
            if !this.fixing {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            let mut read = ReadBuf::new(&mut this.scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Ready(Ok(())) => {
                    if read.filled().is_empty() {
                        this.ended = true;
                    } else {
                        this.input.extend_from_slice(read.filled());
                        this.handle()?;
                    }
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = (u32::try_from(payload.len()).unwrap().to_be_bytes()[1..]).to_vec();
        out.extend_from_slice(&[kind, flags]);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// What h2 would read from `input`, split into frames: (kind, flags, stream, payload).
    async fn through(input: Vec<u8>) -> (Vec<u8>, Vec<(u8, u8, u32, Vec<u8>)>) {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        client.write_all(&input).await.unwrap();
        drop(client);
        let mut fixed = AuthorityFix::new(server, true);
        let mut out = Vec::new();
        fixed.read_to_end(&mut out).await.unwrap();
        (
            out[..PREFACE_LEN].to_vec(),
            whole_frames(&out[PREFACE_LEN..]),
        )
    }

    /// The whole frames at the start of `bytes`: (kind, flags, stream, payload).
    fn whole_frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut frames = Vec::new();
        while bytes.len() >= 9 {
            let len =
                usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
            if bytes.len() < 9 + len {
                break;
            }
            let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
            frames.push((bytes[3], bytes[4], stream, bytes[9..9 + len].to_vec()));
            bytes = &bytes[9 + len..];
        }
        frames
    }

    fn call_headers(authority: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        [
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/tensorflow.serving.PredictionService/Predict"),
            (b":authority", authority),
            (b"te", b"trailers"),
        ]
        .iter()
        .map(|(n, v)| (n.to_vec(), v.to_vec()))
        .collect()
    }

    #[tokio::test]
    async fn a_path_as_authority_becomes_localhost_and_everything_else_passes() {
        const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        // The client's encoder: the path indexed on the first call, referenced on the second.
        let mut client = fluke_hpack::Encoder::new();
        let path_authority = call_headers(b"%2Frun%2Ftfs.sock");
        let pairs = |h: &Vec<(Vec<u8>, Vec<u8>)>| {
            h.iter()
                .map(|(n, v)| (n.to_vec(), v.to_vec()))
                .collect::<Vec<_>>()
        };
        let first = client.encode(path_authority.iter().map(|(n, v)| (&n[..], &v[..])));
        let second = client.encode(path_authority.iter().map(|(n, v)| (&n[..], &v[..])));
        let valid = call_headers(b"localhost:8500");
        let third = client.encode(valid.iter().map(|(n, v)| (&n[..], &v[..])));
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
                                             // HEADERS padded and with a priority, its block split over a CONTINUATION.
        let (head, tail) = first.split_at(first.len() / 2);
        let mut payload = vec![3u8]; // pad length
        payload.extend_from_slice(&[0, 0, 0, 0, 15]); // priority
        payload.extend_from_slice(head);
        payload.extend_from_slice(&[0, 0, 0]);
        input.extend(frame(HEADERS, PADDED | PRIORITY, 1, &payload));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, tail));
        input.extend(frame(0x0, END_STREAM, 1, b"data as it is"));
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &second));
        input.extend(frame(HEADERS, END_HEADERS, 5, &third));
        let (preface, frames) = through(input).await;
        assert_eq!(preface, PREFACE);
        let kinds: Vec<(u8, u8, u32)> = frames.iter().map(|f| (f.0, f.1, f.2)).collect();
        assert_eq!(
            kinds,
            [
                (0x4, 0, 0),
                (HEADERS, END_HEADERS | PRIORITY, 1),
                (0x0, END_STREAM, 1),
                (HEADERS, END_HEADERS | END_STREAM, 3),
                (HEADERS, END_HEADERS, 5),
            ]
        );
        assert_eq!(frames[1].3[..5], [0, 0, 0, 0, 15], "the priority kept");
        assert_eq!(frames[2].3, b"data as it is");
        // What h2's decoder reads, in order, with the state the front door's encoder left.
        let mut server = fluke_hpack::Decoder::new();
        let read = |block: &[u8], server: &mut fluke_hpack::Decoder<'_>| {
            pairs(&server.decode(block).unwrap())
        };
        let localhost = call_headers(b"localhost");
        assert_eq!(read(&frames[1].3[5..], &mut server), localhost);
        assert_eq!(read(&frames[3].3, &mut server), localhost);
        assert_eq!(
            read(&frames[4].3, &mut server),
            valid,
            "a valid authority is kept"
        );
    }

    #[tokio::test]
    async fn a_block_over_several_frames_goes_on_in_one() {
        let mut client = fluke_hpack::Encoder::new();
        let mut headers = call_headers(b"%2Frun%2Ftfs.sock");
        headers.push((b"x-big".to_vec(), vec![b'v'; 40_000]));
        let block = client.encode(headers.iter().map(|(n, v)| (&n[..], &v[..])));
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        for (i, piece) in block.chunks(16_000).enumerate() {
            let kind = if i == 0 { HEADERS } else { CONTINUATION };
            let last = (i + 1) * 16_000 >= block.len();
            input.extend(frame(kind, if last { END_HEADERS } else { 0 }, 1, piece));
        }
        let (_, frames) = through(input).await;
        assert_eq!(frames.len(), 1);
        assert_eq!((frames[0].0, frames[0].1), (HEADERS, END_HEADERS));
        let decoded = fluke_hpack::Decoder::new().decode(&frames[0].3).unwrap();
        assert_eq!(decoded[3].1, b"localhost");
        assert_eq!(decoded[5].1.len(), 40_000);
    }

    async fn ended_by(block: &[u8]) -> io::Error {
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, block));
        let (mut client, server) = tokio::io::duplex(1 << 21);
        client.write_all(&input).await.unwrap();
        drop(client);
        let mut out = Vec::new();
        AuthorityFix::new(server, true)
            .read_to_end(&mut out)
            .await
            .unwrap_err()
    }

    #[tokio::test]
    async fn a_block_hpack_cannot_read_ends_the_connection_and_never_its_task() {
        let blocks: [&[u8]; 3] = [&[0xff; 5], &[0x3f], &[0x3f, 0xff, 0xff, 0xff, 0xff, 0xff]];
        for block in blocks {
            let error = ended_by(block).await;
            assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{block:?}");
        }
    }

    #[tokio::test]
    async fn a_list_h2_ends_the_connection_for_is_handed_to_it_as_one_field_and_nothing_after() {
        // The call's headers with the socket's path, one 4 KB entry in the table, then 65,536
        // one-byte references to it (one frame): 264 MB if decoded whole.
        let mut client = fluke_hpack::Encoder::new();
        let mut headers = call_headers(b"%2Frun%2Ftfs.sock");
        headers.push((b"x-big".to_vec(), vec![b'v'; 4000]));
        let mut block = client.encode(headers.iter().map(|(n, v)| (&n[..], &v[..])));
        block.extend(std::iter::repeat_n(0x80 | 62, 1 << 16));
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &block));
        let next = client.encode(
            call_headers(b"localhost")
                .iter()
                .map(|(n, v)| (&n[..], &v[..])),
        );
        input.extend(frame(HEADERS, END_HEADERS, 3, &next));
        let started = std::time::Instant::now();
        let (_, frames) = through(input).await;
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(frames.len(), 1, "nothing after it");
        assert_eq!(
            (frames[0].0, frames[0].1, frames[0].2),
            (HEADERS, END_HEADERS, 1)
        );
        let fields = fluke_hpack::Decoder::new().decode(&frames[0].3).unwrap();
        assert_eq!(fields.len(), 1);
        // Past h2's bound on one connection (4 times its limit): it sends GOAWAY.
        assert_eq!(fields[0].0.len() + fields[0].1.len() + 32, MAX_LIST + 56);
        assert!(MAX_LIST == 4 * crate::server::MAX_HEADER_LIST as usize);

        // A list of exactly the bound: decoded and passed whole (h2 refuses that call alone,
        // with 431, as over TCP).
        let mut client = fluke_hpack::Encoder::new();
        let mut headers = call_headers(b"%2Frun%2Ftfs.sock");
        let listed: usize = headers.iter().map(|(n, v)| n.len() + v.len() + 32).sum();
        headers.push((b"x-big".to_vec(), vec![b'v'; MAX_LIST - listed - 32 - 5]));
        let block = client.encode(headers.iter().map(|(n, v)| (&n[..], &v[..])));
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &block));
        let (_, frames) = through(input).await;
        let fields = fluke_hpack::Decoder::new().decode(&frames[0].3).unwrap();
        assert_eq!(fields.len(), 6);
        assert_eq!(fields[3].1, b"localhost");
    }

    /// The first RST_STREAM or GOAWAY (kind, error code, GOAWAY's debug data) h2's server sends
    /// after the preface, SETTINGS and `frames`, through the rewrite (`fixing`) or as they came
    /// (the TCP port).
    async fn ending_of(frames: &[u8], fixing: bool) -> Option<(u8, u32, Vec<u8>)> {
        let (mut client, server) = tokio::io::duplex(1 << 22);
        let served = tokio::spawn(async move {
            // Configured as the front door configures hyper's (server.rs).
            let handshake = h2::server::Builder::new()
                .max_frame_size(crate::server::MAX_FRAME)
                .max_header_list_size(crate::server::MAX_HEADER_LIST)
                .handshake::<_, bytes::Bytes>(AuthorityFix::new(server, fixing));
            let Ok(mut connection) = handshake.await else {
                return;
            };
            while let Some(Ok(_)) = connection.accept().await {}
        });
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        client.write_all(&frame(0x4, 0, 0, &[])).await.unwrap();
        client.write_all(frames).await.unwrap();
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), async {
            let mut piece = [0u8; 1 << 16];
            loop {
                match client.read(&mut piece).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => out.extend_from_slice(&piece[..n]),
                }
                if ending_in(&out).is_some() {
                    break;
                }
            }
        });
        read.await.expect("h2 answered within 10 s");
        served.abort();
        ending_in(&out)
    }

    fn ending_in(out: &[u8]) -> Option<(u8, u32, Vec<u8>)> {
        whole_frames(out)
            .into_iter()
            .find_map(|(kind, _, _, payload)| {
                let code = |at: usize| {
                    u32::from_be_bytes([
                        payload[at],
                        payload[at + 1],
                        payload[at + 2],
                        payload[at + 3],
                    ])
                };
                match kind {
                    0x3 => Some((0x3, code(0), Vec::new())),
                    0x7 => Some((0x7, code(4), payload[8..].to_vec())),
                    _ => None,
                }
            })
    }

    #[tokio::test]
    async fn broken_framing_in_a_header_block_gets_h2s_own_goaway_as_on_tcp() {
        let mut client = fluke_hpack::Encoder::new();
        let path = call_headers(b"%2Frun%2Ftfs.sock");
        let block = client.encode(path.iter().map(|(n, v)| (&n[..], &v[..])));
        let (head, tail) = block.split_at(block.len() / 2);
        let opened = frame(HEADERS, 0, 1, head);
        let cases: Vec<(&str, Vec<u8>, u32, &[u8])> = vec![
            (
                "another frame inside the block",
                [opened.clone(), frame(0x0, 0, 1, b"data")].concat(),
                1,
                b"",
            ),
            (
                "a HEADERS frame inside the block",
                [opened.clone(), frame(HEADERS, END_HEADERS, 3, tail)].concat(),
                1,
                b"",
            ),
            (
                "a CONTINUATION of another stream",
                [opened.clone(), frame(CONTINUATION, END_HEADERS, 3, tail)].concat(),
                1,
                b"",
            ),
            (
                "too many CONTINUATIONs",
                [
                    opened.clone(),
                    frame(CONTINUATION, 0, 1, &[]).repeat(MAX_CONTINUATIONS + 1),
                ]
                .concat(),
                0xb,
                b"too_many_continuations",
            ),
            (
                "a HEADERS frame's padding past its end",
                frame(HEADERS, PADDED | END_HEADERS, 1, &[200, 0x82]),
                1,
                b"",
            ),
            (
                "a HEADERS frame too short for its priority",
                frame(HEADERS, PRIORITY | END_HEADERS, 1, &[0, 0]),
                1,
                b"",
            ),
            (
                "a frame past the frame size inside a block",
                [
                    opened.clone(),
                    frame_head(MAX_FRAME + 1, 0x0, 0, [0, 0, 0, 1]).to_vec(),
                ]
                .concat(),
                0x6,
                b"",
            ),
            (
                "a HEADERS frame past the frame size",
                frame_head(MAX_FRAME + 1, HEADERS, END_HEADERS, [0, 0, 0, 1]).to_vec(),
                0x6,
                b"",
            ),
        ];
        for (what, frames, code, debug) in cases {
            let straight = ending_of(&frames, false).await;
            let fixed = ending_of(&frames, true).await;
            let kind_and_code = straight.as_ref().map(|g| (g.0, g.1));
            assert_eq!(kind_and_code, Some((0x7, code)), "{what}: h2 straight");
            assert_eq!(fixed, straight, "{what}");
            if !debug.is_empty() {
                assert_eq!(fixed.map(|g| g.2).unwrap_or_default(), debug, "{what}");
            }
        }
        // The rewrite keeps a block's own frames only while its count is within h2's.
        assert_eq!(MAX_CONTINUATIONS, 5);
        // A list past h2's bound for one connection: its GOAWAY, through the rewrite too.
        let mut client = fluke_hpack::Encoder::new();
        let mut big = call_headers(b"%2Frun%2Ftfs.sock");
        big.push((b"x-big".to_vec(), vec![b'v'; 70_000]));
        let block = client.encode(big.iter().map(|(n, v)| (&n[..], &v[..])));
        let frames = frame(HEADERS, END_HEADERS, 1, &block);
        let straight = ending_of(&frames, false).await;
        assert_eq!(
            straight,
            Some((0x7, 0xb, b"header_list_way_too_large".to_vec()))
        );
        assert_eq!(ending_of(&frames, true).await, straight);
    }

    #[tokio::test]
    async fn a_connection_whose_first_authority_is_valid_passes_as_it_came() {
        // grpc-go, tonic, or a client with grpc.default_authority: decoded once, then nothing.
        let mut client = fluke_hpack::Encoder::new();
        let valid = call_headers(b"localhost");
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(0x4, 0, 0, &[]));
        for stream in [1u32, 3, 5] {
            let block = client.encode(valid.iter().map(|(n, v)| (&n[..], &v[..])));
            let (head, tail) = block.split_at(block.len() / 2);
            input.extend(frame(HEADERS, 0, stream, head));
            input.extend(frame(CONTINUATION, END_HEADERS, stream, tail));
            input.extend(frame(0x0, END_STREAM, stream, b"tensor bytes"));
        }
        let (mut writer, server) = tokio::io::duplex(1 << 20);
        writer.write_all(&input).await.unwrap();
        drop(writer);
        let mut out = Vec::new();
        let mut fixed = AuthorityFix::new(server, true);
        fixed.read_to_end(&mut out).await.unwrap();
        assert_eq!(out, input);
        assert!(!fixed.fixing, "decided after the first block");
    }

    #[tokio::test]
    async fn off_it_passes_every_byte_as_it_is() {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend(frame(HEADERS, END_HEADERS, 1, &[0xff; 5]));
        let (mut client, server) = tokio::io::duplex(1 << 16);
        client.write_all(&bytes).await.unwrap();
        drop(client);
        let mut out = Vec::new();
        AuthorityFix::new(server, false)
            .read_to_end(&mut out)
            .await
            .unwrap();
        assert_eq!(out, bytes);
    }
}
