//! A gRPC connection's first bytes, awaited with a time limit before hyper gets them.
//!
//! hyper's HTTP/2 server waits for ever for a client's connection preface: measured, 300
//! connections that sent nothing were all still open 10 s later, each a descriptor and a task,
//! and its pings start only once the preface has come. Here a client has the limit on a
//! client that stops sending (`--request-read-timeout`) to send the preface's 24 bytes, or its
//! connection is closed; the bytes read are handed to hyper first (`Rewound`), so hyper sees
//! the connection as it came.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// HTTP/2's client connection preface, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", is this long.
pub const PREFACE_LEN: usize = 24;

/// A connection with its first `PREFACE_LEN` bytes read ahead, to be read again first.
pub struct Rewound<I> {
    head: [u8; PREFACE_LEN],
    /// How much of `head` has been read again (all of it when nothing was read ahead).
    given: usize,
    inner: I,
}

/// `io` once its client has sent `PREFACE_LEN` bytes, or an error: TimedOut when `limit`
/// passed first, UnexpectedEof when the client closed first. Without a limit nothing is read
/// ahead.
pub async fn read_start<I: AsyncRead + Unpin>(
    mut io: I,
    limit: Option<Duration>,
) -> io::Result<Rewound<I>> {
    let mut head = [0u8; PREFACE_LEN];
    let Some(limit) = limit else {
        return Ok(Rewound {
            head,
            given: PREFACE_LEN,
            inner: io,
        });
    };
    match tokio::time::timeout(limit, io.read_exact(&mut head)).await {
        Ok(Ok(_)) => Ok(Rewound {
            head,
            given: 0,
            inner: io,
        }),
        Ok(Err(error)) => Err(error),
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "no HTTP/2 connection preface",
        )),
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Rewound<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.given < PREFACE_LEN {
            let n = (PREFACE_LEN - this.given).min(buf.remaining());
            buf.put_slice(&this.head[this.given..this.given + n]);
            this.given += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Rewound<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    // hyper writes frames with writev when the stream can: keep it.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    const PREFACE: &[u8; PREFACE_LEN] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    #[tokio::test]
    async fn the_preface_read_ahead_is_read_again_first_then_the_rest() {
        let (mut client, server) = tokio::io::duplex(1024);
        client.write_all(PREFACE).await.expect("write");
        client.write_all(b"SETTINGS").await.expect("write");
        let mut started = read_start(server, Some(Duration::from_secs(5)))
            .await
            .expect("the preface came");
        // Read in small pieces: the read-ahead bytes come back across reads.
        let mut seen = Vec::new();
        let mut piece = [0u8; 5];
        while seen.len() < PREFACE_LEN + 8 {
            let n = started.read(&mut piece).await.expect("read");
            seen.extend_from_slice(&piece[..n]);
        }
        assert_eq!(&seen[..PREFACE_LEN], PREFACE);
        assert_eq!(&seen[PREFACE_LEN..], b"SETTINGS");
        started
            .write_all(b"answer")
            .await
            .expect("writes pass through");
        let mut answer = [0u8; 6];
        client.read_exact(&mut answer).await.expect("read");
        assert_eq!(&answer, b"answer");
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_sends_less_than_the_preface_in_time_is_timed_out() {
        let (mut client, server) = tokio::io::duplex(1024);
        client.write_all(&PREFACE[..10]).await.expect("write");
        let error = read_start(server, Some(Duration::from_secs(3)))
            .await
            .err()
            .expect("timed out");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        drop(client);
    }

    #[tokio::test]
    async fn a_client_that_closes_first_ends_the_wait() {
        let (client, server) = tokio::io::duplex(1024);
        drop(client);
        let error = read_start(server, Some(Duration::from_secs(3)))
            .await
            .err()
            .expect("ended");
        assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[tokio::test]
    async fn without_a_limit_nothing_is_read_ahead() {
        let (mut client, server) = tokio::io::duplex(1024);
        let mut started = read_start(server, None).await.expect("at once");
        client.write_all(b"abc").await.expect("write");
        let mut seen = [0u8; 3];
        started.read_exact(&mut seen).await.expect("read");
        assert_eq!(&seen, b"abc");
    }
}
