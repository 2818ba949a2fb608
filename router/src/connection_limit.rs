//! How many client connections the front door keeps at once (`--max-connections`, gRPC and
//! REST together), and the file descriptors that leaves for the pool's own sockets.
//!
//! Every open connection holds a file descriptor, and memory the request budget does not see
//! (hyper's and h2's buffers; what h2 queues of an answer beyond its stream's window, up to
//! two pieces of 64 KiB per stream). Without a limit, 300 idle connections against a
//! descriptor limit of 256 (measured) left the front door unable to take a new client, or the
//! connection of a worker started in place of one that died: the pool could not heal until
//! the flood ended. Here a connection past the limit is accepted and closed at once, told why
//! in one write when that can be done (an HTTP/2 GOAWAY on the gRPC port, a 503 on the REST
//! port), as nginx closes those past its worker_connections; and the limit is kept under what
//! the descriptor limit allows, leaving `RESERVED_DESCRIPTORS` for listeners, workers, the
//! control channel, metrics scrapes and files.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Descriptors kept for the front door's own use beyond those open when the limit is set:
/// every worker's connection (a GPU pod's 48 contexts, twice while a version replaces
/// another), its replacement's, metrics scrapes and control connections, with room to spare.
pub const RESERVED_DESCRIPTORS: usize = 256;

/// The open client connections and their limit; one per front door, shared by the accept
/// loops (the only callers of `admit`) and metrics.
pub struct ConnectionLimit {
    most: usize,
    open: AtomicUsize,
    refused: AtomicU64,
    /// gRPC connections ended for idleness (lifespan).
    idle_closed: AtomicU64,
}

/// An admitted connection's place under the limit, given back when dropped (when its serving
/// task ends, however it ends).
pub struct Admitted {
    limit: Arc<ConnectionLimit>,
}

impl Admitted {
    /// Notes how the connection holding this place ended.
    pub fn ended(&self, end: crate::lifespan::Ended) {
        if end == crate::lifespan::Ended::Idle {
            self.limit.idle_closed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.limit.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ConnectionLimit {
    /// At most `most` connections at once (at least one).
    pub fn new(most: usize) -> Arc<ConnectionLimit> {
        Arc::new(ConnectionLimit {
            most: most.max(1),
            open: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            idle_closed: AtomicU64::new(0),
        })
    }

    /// A place for a connection just accepted, or None when `most` are open (counted as
    /// refused; the caller closes it).
    pub fn admit(self: &Arc<Self>) -> Option<Admitted> {
        let taken = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.most).then_some(open + 1)
            });
        match taken {
            Ok(_) => Some(Admitted {
                limit: Arc::clone(self),
            }),
            Err(_) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    pub fn most(&self) -> usize {
        self.most
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Connections refused since start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// gRPC connections ended for idleness since start (`--max-connection-idle`).
    pub fn idle_closed(&self) -> u64 {
        self.idle_closed.load(Ordering::Relaxed)
    }
}

/// What `--max-connections` comes to under a descriptor limit of `descriptors` with `open`
/// descriptors already in use: `wanted` (0: no limit of its own), or less when the
/// descriptors would run out first (never under 1).
pub fn connections_allowed(wanted: usize, descriptors: u64, open: usize) -> usize {
    let room = usize::try_from(descriptors)
        .unwrap_or(usize::MAX)
        .saturating_sub(open)
        .saturating_sub(RESERVED_DESCRIPTORS)
        .max(1);
    if wanted == 0 {
        room
    } else {
        wanted.min(room)
    }
}

/// Raises this process's soft limit on open descriptors to its hard limit (what a server
/// should do: the soft limit guards programs that use select(), which the front door does
/// not; Go's runtime does the same at start) and returns the soft limit then in force.
pub fn raise_descriptor_limit() -> std::io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read or write the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return Ok(raised.rlim_cur);
        }
    }
    Ok(limit.rlim_cur)
}

/// Descriptors this process has open now (None when /proc cannot say).
pub fn open_descriptors() -> Option<usize> {
    std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|entries| entries.count())
}

/// What a gRPC client refused for the limit is sent before its connection is closed: the
/// server's HTTP/2 preface (an empty SETTINGS frame) and a GOAWAY with ENHANCE_YOUR_CALM,
/// its debug data saying why (gRPC clients log it).
pub fn grpc_refusal(most: usize) -> Vec<u8> {
    let debug = refusal_text(most);
    let mut out = Vec::with_capacity(9 + 9 + 8 + debug.len());
    // SETTINGS: length 0, type 0x4, no flags, stream 0.
    out.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    // GOAWAY: type 0x7, stream 0; last stream 0, ENHANCE_YOUR_CALM (0xb), the debug data.
    let length = u32::try_from(8 + debug.len()).unwrap_or(8);
    out.extend_from_slice(&length.to_be_bytes()[1..]);
    out.extend_from_slice(&[0x7, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&0u32.to_be_bytes());
    out.extend_from_slice(&0xbu32.to_be_bytes());
    out.extend_from_slice(debug.as_bytes());
    out
}

/// What a REST client refused for the limit is sent: 503, in TF Serving's error shape.
pub fn rest_refusal(most: usize) -> Vec<u8> {
    let body = format!("{{ \"error\": \"{}\" }}", refusal_text(most));
    http_503("application/json", &body)
}

/// A whole HTTP/1.1 503 answer of `body`, after which the connection closes.
pub fn http_503(content_type: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: {content_type}\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn refusal_text(most: usize) -> String {
    format!(
        "the front door has {most} client connections open, the most it keeps at once \
         (--max-connections); try again later or reuse a connection"
    )
}

/// The most of what a refused client already sent that is read before its connection is
/// closed (the accept loop does it inline: a client streaming bytes must not hold it).
const REFUSED_READ_BYTES: usize = 64 << 10;

/// Closes a connection refused for the limit, after telling its client why when the words
/// fit its socket's buffer at once (a fresh socket's always do). Before the close, what the
/// client has already sent is read (up to `REFUSED_READ_BYTES`), so that the close is a FIN
/// rather than a reset that could overtake the words; what it sends later still meets a
/// reset. Done on the plain socket, taken from tokio's reactor: tokio's own try_write and
/// try_read answer WouldBlock without a system call until the reactor has seen the socket
/// ready, which before tokio 1.54 it had not for a socket fresh from accept.
pub fn refuse(stream: tokio::net::TcpStream, words: &[u8]) {
    if let Ok(stream) = stream.into_std() {
        say_and_close(stream, words);
    } // else dropped: closed without a word
}

/// `refuse` for a connection to the UNIX socket (`--grpc_socket_path`).
pub fn refuse_unix(stream: tokio::net::UnixStream, words: &[u8]) {
    if let Ok(stream) = stream.into_std() {
        say_and_close(stream, words);
    }
}

/// The words, then what the client sent already, read (the socket is non-blocking, as tokio
/// left it), then the close as the stream drops.
fn say_and_close(mut stream: impl std::io::Read + std::io::Write, words: &[u8]) {
    let _ = stream.write(words);
    let mut scratch = [0u8; 16 << 10];
    let mut read = 0;
    while read < REFUSED_READ_BYTES {
        match stream.read(&mut scratch) {
            Ok(n) if n > 0 => read += n,
            _ => break, // the end, nothing more for now (non-blocking), or an error
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_limit_and_gives_places_back_when_dropped() {
        let limit = ConnectionLimit::new(2);
        let first = limit.admit().expect("first");
        let second = limit.admit().expect("second");
        assert!(limit.admit().is_none());
        assert_eq!((limit.open(), limit.refused()), (2, 1));
        drop(first);
        assert_eq!(limit.open(), 1);
        let third = limit.admit().expect("a place was given back");
        assert!(limit.admit().is_none());
        assert_eq!((limit.open(), limit.refused()), (2, 2));
        drop((second, third));
        assert_eq!(limit.open(), 0);
    }

    #[test]
    fn a_limit_of_zero_still_admits_one() {
        let limit = ConnectionLimit::new(0);
        let only = limit.admit();
        assert!(only.is_some());
        assert!(limit.admit().is_none());
    }

    #[test]
    fn threads_admitting_at_once_share_exactly_the_limit() {
        let limit = ConnectionLimit::new(8);
        let rounds = 200;
        let together = Arc::new(std::sync::Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (limit, together) = (limit.clone(), together.clone());
                std::thread::spawn(move || {
                    for _ in 0..rounds {
                        let held: Vec<_> = (0..3).filter_map(|_| limit.admit()).collect();
                        // Every thread has tried its three: exactly the limit is open.
                        together.wait();
                        assert_eq!(limit.open(), 8);
                        together.wait();
                        drop(held);
                        together.wait();
                    }
                })
            })
            .collect();
        for thread in threads {
            thread
                .join()
                .expect("no thread saw more or fewer than the limit open");
        }
        assert_eq!(limit.open(), 0);
        assert_eq!(limit.refused(), rounds * (8 * 3 - 8));
    }

    #[test]
    fn the_limit_leaves_the_reserve_of_descriptors() {
        let open = 30;
        // Plenty of descriptors: the flag's value.
        assert_eq!(connections_allowed(1024, 1 << 20, open), 1024);
        // 0: only the descriptors limit.
        assert_eq!(
            connections_allowed(0, 4096, open),
            4096 - open - RESERVED_DESCRIPTORS
        );
        // Too few descriptors for the flag: what they leave.
        assert_eq!(
            connections_allowed(1024, 1024, open),
            1024 - open - RESERVED_DESCRIPTORS
        );
        // Fewer than the reserve: still one.
        assert_eq!(connections_allowed(1024, 100, open), 1);
    }

    #[test]
    fn the_descriptor_limit_is_raised_to_the_hard_one() {
        let soft = raise_descriptor_limit().expect("getrlimit");
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct passed.
        assert_eq!(
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
            0
        );
        assert_eq!(soft, limit.rlim_cur);
        assert_eq!(limit.rlim_cur, limit.rlim_max);
        assert!(open_descriptors().is_some_and(|open| open >= 3));
    }

    #[test]
    fn the_grpc_refusal_is_a_settings_frame_then_a_goaway_saying_why() {
        let words = grpc_refusal(7);
        assert_eq!(&words[..9], &[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        let goaway = &words[9..];
        let length =
            usize::from(goaway[0]) << 16 | usize::from(goaway[1]) << 8 | usize::from(goaway[2]);
        assert_eq!(length, goaway.len() - 9);
        assert_eq!(goaway[3], 0x7, "GOAWAY");
        assert_eq!(&goaway[5..9], &[0, 0, 0, 0], "on stream 0");
        assert_eq!(&goaway[9..13], &[0, 0, 0, 0], "no stream was processed");
        assert_eq!(&goaway[13..17], &[0, 0, 0, 0xb], "ENHANCE_YOUR_CALM");
        let debug = std::str::from_utf8(&goaway[17..]).expect("text");
        assert!(debug.contains("7 client connections") && debug.contains("--max-connections"));
    }

    #[test]
    fn the_rest_refusal_is_a_whole_503_in_tf_servings_error_shape() {
        let words = String::from_utf8(rest_refusal(3)).expect("text");
        let (head, body) = words.split_once("\r\n\r\n").expect("a head and a body");
        assert!(head.starts_with("HTTP/1.1 503 "));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let error: serde_json::Value = serde_json::from_str(body).expect("JSON");
        assert!(error["error"]
            .as_str()
            .is_some_and(|e| e.contains("--max-connections")));
    }
}
