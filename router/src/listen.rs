//! The front door's TCP listeners. A wildcard host (`0.0.0.0` or `::`) listens on both IPv4
//! and IPv6, as TF Serving does: its gRPC server's `0.0.0.0:port` is a family-agnostic
//! wildcard to gRPC's C core, which opens one dual-stack `[::]` socket, and its REST server
//! binds `::`. Bound to IPv4 alone, a pool on an IPv6 or IPv6-first cluster never became
//! Ready: the kubelet's probes, the Service and Prometheus dial the pod's IPv6 address (found
//! by a review of deploy/). Where the host has no IPv6, the wildcard is IPv4's alone.

use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;

/// As many connections waiting to be accepted as tokio's own `TcpListener::bind` allows.
const BACKLOG: i32 = 1024;

/// A listener on `host:port` (port 0: any free port); a wildcard host takes both families.
pub async fn bind(host: &str, port: u16) -> io::Result<TcpListener> {
    match host.parse::<IpAddr>() {
        Ok(ip) if ip.is_unspecified() => match dual_stack(port) {
            Ok(listener) => Ok(listener),
            Err(error) if no_ipv6(&error) => TcpListener::bind((host, port)).await,
            Err(error) => Err(error),
        },
        _ => TcpListener::bind((host, port)).await,
    }
}

/// One `[::]:port` socket that IPv4 clients reach too (as `::ffff:a.b.c.d`), whatever the
/// system's `net.ipv6.bindv6only` says.
fn dual_stack(port: u16) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP))?;
    socket.set_only_v6(false)?;
    // As tokio's bind: a restarted front door takes its port back while the old
    // connections are in TIME_WAIT.
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into())?;
    socket.listen(BACKLOG)?;
    TcpListener::from_std(socket.into())
}

/// Whether an error says the host has no IPv6 (a kernel without it, or it turned off):
/// then the wildcard is IPv4's. Any other error (the port taken) is the listener's.
fn no_ipv6(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL | libc::EPROTONOSUPPORT)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Whether a client at `address` reaches `listener` (one byte each way).
    async fn reaches(listener: &TcpListener, address: SocketAddr) -> bool {
        let Ok(mut client) = tokio::net::TcpStream::connect(address).await else {
            return false;
        };
        let Ok((mut served, _)) = listener.accept().await else {
            return false;
        };
        let mut byte = [0u8; 1];
        client.write_all(b"x").await.is_ok()
            && served.read_exact(&mut byte).await.is_ok()
            && byte == *b"x"
    }

    fn has_ipv6_loopback() -> bool {
        std::net::TcpListener::bind("[::1]:0").is_ok()
    }

    #[tokio::test]
    async fn a_wildcard_listens_on_both_families() {
        for host in ["0.0.0.0", "::"] {
            let listener = bind(host, 0).await.expect("a wildcard listener");
            let port = listener.local_addr().expect("its address").port();
            let v4 = SocketAddr::from(([127, 0, 0, 1], port));
            assert!(reaches(&listener, v4).await, "{host}: 127.0.0.1");
            if has_ipv6_loopback() {
                let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
                assert!(reaches(&listener, v6).await, "{host}: ::1");
            }
        }
    }

    #[tokio::test]
    async fn a_named_address_is_that_address_alone() {
        let listener = bind("127.0.0.1", 0).await.expect("a listener");
        let port = listener.local_addr().expect("its address").port();
        assert!(reaches(&listener, SocketAddr::from(([127, 0, 0, 1], port))).await);
        if has_ipv6_loopback() {
            let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
            assert!(tokio::net::TcpStream::connect(v6).await.is_err());
        }
    }

    #[tokio::test]
    async fn a_taken_port_is_an_error_not_a_fallback() {
        let first = bind("0.0.0.0", 0).await.expect("a listener");
        let port = first.local_addr().expect("its address").port();
        let error = bind("0.0.0.0", port).await.expect_err("the port is taken");
        assert_eq!(error.kind(), io::ErrorKind::AddrInUse, "{error}");
    }
}
