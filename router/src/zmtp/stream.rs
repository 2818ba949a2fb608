//! A worker connection's descriptor, watched by the runtime for reading only.
//!
//! Why not tokio's `UnixStream`: it registers its socket for reading and writing, edge
//! triggered, and a Unix stream socket reports "writable" every time its peer reads (the
//! kernel wakes a Unix socket's writers whenever buffer space frees, where TCP does so only
//! after a write found none). So each request a worker read woke the front door once for
//! nothing: at concurrency 1, `strace` showed an `epoll_wait` returning EPOLLOUT alone between
//! every send to a worker and its answer (3 waits, so 3 sleeps and wake-ups, per request).
//!
//! Here the socket is registered for reading; writes are tried directly, and only a write
//! that finds the socket full registers a duplicate descriptor for writing, for as long as the
//! writer waits (`WriteWait`).

use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

use bytes::{BufMut, BytesMut};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

pub(super) struct PeerStream {
    read: AsyncFd<UnixStream>,
}

impl PeerStream {
    /// Takes over an accepted connection (its registration with both interests is dropped).
    /// Must be called inside a tokio runtime.
    pub(super) fn new(stream: tokio::net::UnixStream) -> io::Result<PeerStream> {
        // into_std deregisters it and leaves the descriptor non-blocking.
        let stream = stream.into_std()?;
        Ok(PeerStream {
            read: watch(stream, Interest::READABLE)?,
        })
    }

    /// Appends what the socket holds to `buffer` (at least one byte; waits until there is
    /// one); `Ok(0)` is end-of-file.
    pub(super) async fn read_buf(&self, buffer: &mut BytesMut) -> io::Result<usize> {
        loop {
            let mut ready = self.read.readable().await?;
            let room = buffer.capacity() - buffer.len();
            match ready.try_io(|fd| recv_into(fd.as_raw_fd(), buffer)) {
                Ok(Ok(n)) => {
                    // A read that left room drained the socket: forget the readiness now
                    // rather than learn it from a read that says EAGAIN (tokio's own
                    // poll_read does the same). An event newer than this guard survives.
                    if n < room {
                        ready.clear_ready();
                    }
                    return Ok(n);
                }
                Ok(Err(error)) => return Err(error),
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes what the kernel takes of `data` now, without waiting (WouldBlock: nothing).
    pub(super) fn try_write(&self, data: &[u8]) -> io::Result<usize> {
        let mut socket: &UnixStream = self.read.get_ref();
        socket.write(data)
    }

    /// Until the socket may take more, for a writer that found it full. `wait` holds the
    /// registration for writing between the waits of one backlog (None: it is made now);
    /// the writer drops it when it has nothing left to write.
    pub(super) async fn writable(&self, wait: &mut Option<WriteWait>) -> io::Result<()> {
        let room = match wait {
            Some(room) => room,
            None => wait.insert(self.wait_for_room()?),
        };
        room.writable().await
    }

    /// A registration for writing, made from a duplicate descriptor (one descriptor cannot be
    /// registered twice); dropping it deregisters and closes the duplicate.
    fn wait_for_room(&self) -> io::Result<WriteWait> {
        let duplicate = self.read.get_ref().try_clone()?;
        Ok(WriteWait(watch(duplicate, Interest::WRITABLE)?))
    }
}

impl AsRawFd for PeerStream {
    fn as_raw_fd(&self) -> RawFd {
        self.read.as_raw_fd()
    }
}

pub(super) struct WriteWait(AsyncFd<UnixStream>);

impl WriteWait {
    /// Until the socket may take more (at once when it already can: registering reports the
    /// state the socket is in, so room made before the registration is not missed).
    async fn writable(&self) -> io::Result<()> {
        let mut ready = self.0.writable().await?;
        // The writer's next write decides; a full socket again brings a new edge.
        ready.clear_ready();
        Ok(())
    }
}

/// Registers `socket` with the runtime for `interest` only.
fn watch(socket: UnixStream, interest: Interest) -> io::Result<AsyncFd<UnixStream>> {
    // SAFETY: the UnixStream owns its descriptor, moves into the AsyncFd and returns that same
    // descriptor until the AsyncFd (which deregisters it first) drops it.
    unsafe { AsyncFd::register_with_interest(socket, interest) }.map_err(|e| e.into_parts().1)
}

/// One recv(2) into the spare capacity of `buffer` (BytesMut makes room when it has none).
fn recv_into(fd: RawFd, buffer: &mut BytesMut) -> io::Result<usize> {
    let spare = buffer.chunk_mut();
    let room = spare.len();
    // SAFETY: recv writes at most `room` bytes into the buffer's spare capacity, which
    // `chunk_mut` hands out as writable memory of that length; only the bytes it reports
    // written are then marked initialised.
    let n = unsafe { libc::recv(fd, spare.as_mut_ptr().cast(), room, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = n as usize;
    // SAFETY: the kernel initialised these `n` (≤ room) bytes.
    unsafe { buffer.advance_mut(n) };
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// What the epoll instances of this process watch the descriptor `fd` for: the `events`
    /// masks of its registrations, read from /proc/self/fdinfo (`tfd` is the descriptor,
    /// `ino` its file's inode, which tells it from a later descriptor with that number). A
    /// registration can be listed more than once: tokio's driver holds its epoll descriptor
    /// twice (mio's registry is a duplicate).
    fn watched_for(fd: RawFd) -> Vec<u32> {
        use std::os::unix::fs::MetadataExt;
        let inode = std::fs::metadata(format!("/proc/self/fd/{fd}"))
            .expect("the descriptor is open")
            .ino();
        let mut masks = Vec::new();
        for entry in std::fs::read_dir("/proc/self/fd").expect("/proc is mounted") {
            let Ok(entry) = entry else { continue };
            let target = std::fs::read_link(entry.path()).unwrap_or_default();
            if target.to_string_lossy() != "anon_inode:[eventpoll]" {
                continue;
            }
            let info = std::fs::read_to_string(format!(
                "/proc/self/fdinfo/{}",
                entry.file_name().to_string_lossy()
            ))
            .unwrap_or_default();
            for line in info.lines().filter(|l| l.starts_with("tfd:")) {
                // "tfd:        3 events: 80000019 data:  3  pos:0 ino:90cf sdev:9"
                let fields: Vec<&str> = line.split_whitespace().collect();
                let value = |key: &str| {
                    let at = fields.iter().position(|f| f.starts_with(key))?;
                    match &fields[at][key.len()..] {
                        "" => fields.get(at + 1).copied(),
                        glued => Some(glued),
                    }
                };
                let same_fd = value("tfd:").and_then(|v| v.parse::<RawFd>().ok()) == Some(fd);
                let same_file =
                    value("ino:").and_then(|v| u64::from_str_radix(v, 16).ok()) == Some(inode);
                if same_fd && same_file {
                    if let Some(mask) =
                        value("events:").and_then(|v| u32::from_str_radix(v, 16).ok())
                    {
                        masks.push(mask);
                    }
                }
            }
        }
        masks
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    }

    #[test]
    fn a_connection_is_watched_for_reading_only() {
        let runtime = runtime();
        runtime.block_on(async {
            let (ours, mut theirs) = UnixStream::pair().unwrap();
            ours.set_nonblocking(true).unwrap();
            let tokio_stream = tokio::net::UnixStream::from_std(ours).unwrap();
            let fd = tokio_stream.as_raw_fd();
            // What the tokio stream asks for, to show the check can see the difference.
            let before = watched_for(fd);
            let out = libc::EPOLLOUT as u32;
            assert!(
                !before.is_empty() && before.iter().all(|mask| mask & out != 0),
                "tokio's UnixStream: {before:x?}"
            );
            let stream = PeerStream::new(tokio_stream).unwrap();
            let after = watched_for(fd);
            assert!(!after.is_empty(), "registered");
            for mask in after {
                assert_ne!(mask & libc::EPOLLIN as u32, 0, "{mask:x}");
                assert_eq!(mask & out, 0, "{mask:x}");
            }

            // Both ways still work.
            assert_eq!(stream.try_write(b"ping").unwrap(), 4);
            let mut got = [0u8; 4];
            theirs.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"ping");
            theirs.write_all(b"pong").unwrap();
            let mut buffer = BytesMut::new();
            while buffer.len() < 4 {
                assert!(stream.read_buf(&mut buffer).await.unwrap() > 0);
            }
            assert_eq!(&buffer[..], b"pong");
            drop(theirs);
            assert_eq!(
                stream.read_buf(&mut buffer).await.unwrap(),
                0,
                "end-of-file"
            );
        });
    }

    #[test]
    fn a_writer_that_found_the_socket_full_is_woken_when_the_peer_reads() {
        let runtime = runtime();
        runtime.block_on(async {
            let (ours, theirs) = UnixStream::pair().unwrap();
            ours.set_nonblocking(true).unwrap();
            let stream = PeerStream::new(tokio::net::UnixStream::from_std(ours).unwrap()).unwrap();
            let chunk = vec![7u8; 64 * 1024];
            let mut written = 0usize;
            loop {
                match stream.try_write(&chunk) {
                    Ok(n) => written += n,
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                    Err(error) => panic!("{error}"),
                }
            }
            let wait = stream.wait_for_room().unwrap();
            let fd = wait.0.as_raw_fd();
            let masks = watched_for(fd);
            assert!(!masks.is_empty() && masks.iter().all(|m| m & libc::EPOLLOUT as u32 != 0));
            // Full: no room until the peer reads.
            let early =
                tokio::time::timeout(std::time::Duration::from_millis(50), wait.writable()).await;
            assert!(early.is_err(), "writable while full");
            let reader = std::thread::spawn(move || {
                let mut theirs = theirs;
                let mut all = Vec::new();
                theirs.read_to_end(&mut all).map(|_| all.len())
            });
            tokio::time::timeout(std::time::Duration::from_secs(5), wait.writable())
                .await
                .expect("woken once the peer read")
                .unwrap();
            assert!(stream.try_write(b"more").unwrap() > 0);
            written += 4;
            drop(wait);
            drop(stream);
            assert_eq!(reader.join().unwrap().unwrap(), written);
        });
    }
}
