//! Who is at the other end of a loopback TCP connection: the uid that owns the client's
//! socket, read from the kernel's socket tables (`/proc/net/tcp`, `/proc/net/tcp6`), where
//! the client's socket is the entry whose local address is the connection's peer address.
//!
//! An admin action over TCP is taken from this host only; "this host" let any local user
//! add a model to a pool running as root, whose workers then ran that user's SavedModel (its
//! ReadFile/WriteFile ops) as root (found by a hunt). The `--grpc_socket_path` socket needs
//! none of this: it is 0700, its user's alone.

use std::net::{IpAddr, SocketAddr};

/// The uid owning the client socket of the connection from `peer` to `ours` (this front
/// door's end of it), a loopback connection of this host; None when no table lists it
/// established (the client is gone, or /proc is not there). The whole connection is matched,
/// and only while established: matched by the client's address alone, a TIME_WAIT entry of
/// another connection from the same address (which the kernel lists as root's) came first,
/// and a local user who made such entries, then connected from that address, passed for
/// root (found by a hunt).
pub fn loopback_peer_uid(peer: SocketAddr, ours: SocketAddr) -> Option<u32> {
    let mut tables: Vec<(&str, String, String)> = Vec::new();
    // An IPv4 peer's socket may be an IPv6 one connected to a mapped address (gRPC's C core
    // makes dual-stack sockets): it is listed in the IPv6 table as ::ffff:a.b.c.d. A
    // dual-stack listener sees an IPv4 client as ::ffff:a.b.c.d, whose socket may be in
    // either table too.
    let v4 = |address: SocketAddr| match address.ip() {
        IpAddr::V4(ip) => Some(ip),
        IpAddr::V6(ip) => ip.to_ipv4_mapped(),
    };
    if let (Some(client), Some(server)) = (v4(peer), v4(ours)) {
        tables.push((
            "/proc/net/tcp",
            v4_key(client.octets(), peer.port()),
            v4_key(server.octets(), ours.port()),
        ));
    }
    let v6 = |address: SocketAddr| match address.ip() {
        IpAddr::V4(ip) => ip.to_ipv6_mapped(),
        IpAddr::V6(ip) => ip,
    };
    tables.push((
        "/proc/net/tcp6",
        v6_key(v6(peer).octets(), peer.port()),
        v6_key(v6(ours).octets(), ours.port()),
    ));
    tables.into_iter().find_map(|(path, local, remote)| {
        let table = std::fs::read_to_string(path).ok()?;
        uid_of(&table, &local, &remote)
    })
}

/// How the kernel writes an IPv4 address and port: the address's 4 bytes as one native-endian
/// word in hex, the port in hex.
fn v4_key(octets: [u8; 4], port: u16) -> String {
    format!("{:08X}:{port:04X}", u32::from_ne_bytes(octets))
}

/// An IPv6 address as four native-endian words in hex, then the port.
fn v6_key(octets: [u8; 16], port: u16) -> String {
    let mut key = String::with_capacity(37);
    for word in octets.chunks_exact(4) {
        let bytes = [word[0], word[1], word[2], word[3]];
        key.push_str(&format!("{:08X}", u32::from_ne_bytes(bytes)));
    }
    key.push_str(&format!(":{port:04X}"));
    key
}

/// The kernel's state of an established connection (`st`).
const ESTABLISHED: &str = "01";

/// The uid column of the established entry from `local` to `remote` (`sl local rem st
/// tx:rx tr:when retrnsmt uid ...`).
fn uid_of(table: &str, local: &str, remote: &str) -> Option<u32> {
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(1) == Some(&local)
            && fields.get(2) == Some(&remote)
            && fields.get(3) == Some(&ESTABLISHED))
        .then(|| fields.get(7).and_then(|uid| uid.parse().ok()))
        .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_table_is_read_by_the_whole_established_connection() {
        // Before the client's own entry: the listener's, and a TIME_WAIT one from the same
        // client address to another port (root's, as the kernel lists them all).
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0\n\
   1: 0100007F:C350 0100007F:2000 06 00000000:00000000 03:00000000 00000000     0        0 0 3 0000000000000000\n\
   2: 0100007F:C350 0100007F:1F90 01 00000000:00000000 00:00000000 00000000 65534        0 2 1 0000000000000000 20 4 30 10 -1\n";
        let client = v4_key([127, 0, 0, 1], 0xC350);
        let server = v4_key([127, 0, 0, 1], 0x1F90);
        assert_eq!(
            client,
            format!("{:08X}:C350", u32::from_ne_bytes([127, 0, 0, 1]))
        );
        assert_eq!(uid_of(table, &client, &server), Some(65534));
        // The TIME_WAIT entry is no one's connection to this front door.
        assert_eq!(
            uid_of(table, &client, &v4_key([127, 0, 0, 1], 0x2000)),
            None
        );
        assert_eq!(uid_of(table, &v4_key([127, 0, 0, 1], 1), &server), None);
        let loopback6 = v6_key(std::net::Ipv6Addr::LOCALHOST.octets(), 0x50);
        assert_eq!(loopback6.len(), 32 + 5);
        assert!(loopback6.ends_with(&format!("{:08X}:0050", u32::from_ne_bytes([0, 0, 0, 1]))));
    }

    /// An IPv6 socket connected to an IPv4 listener through a mapped address (what gRPC's C
    /// core makes): the listener sees an IPv4 peer, the kernel lists the socket as IPv6.
    #[test]
    fn a_dual_stack_client_of_an_ipv4_listener_is_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
        let port = listener.local_addr().expect("a bound address").port();
        let mapped: SocketAddr = format!("[::ffff:127.0.0.1]:{port}")
            .parse()
            .expect("a mapped address");
        let Ok(_client) = std::net::TcpStream::connect(mapped) else {
            return; // no IPv6 here: no dual-stack clients either
        };
        let (server_side, peer) = listener.accept().expect("the connection accepted");
        assert!(peer.is_ipv4());
        let ours = server_side.local_addr().expect("the front door's end");
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        assert_eq!(loopback_peer_uid(peer, ours), Some(uid));
    }

    /// A connection this process makes over loopback is found, and is this process's user's.
    #[test]
    fn a_real_loopback_connection_is_its_makers() {
        for bind in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(listener) = std::net::TcpListener::bind(bind) else {
                continue; // no IPv6 loopback here
            };
            let address = listener.local_addr().expect("a bound address");
            let client = std::net::TcpStream::connect(address).expect("a loopback connection");
            let (server_side, peer) = listener.accept().expect("the connection accepted");
            assert_eq!(peer, client.local_addr().expect("the client's address"));
            let ours = server_side.local_addr().expect("the front door's end");
            // SAFETY: getuid has no preconditions and cannot fail.
            let uid = unsafe { libc::getuid() };
            assert_eq!(loopback_peer_uid(peer, ours), Some(uid), "{bind}");
            // Not another connection's: the same client to another end is no one's.
            let elsewhere = SocketAddr::new(ours.ip(), ours.port().wrapping_add(1));
            assert_eq!(loopback_peer_uid(peer, elsewhere), None, "{bind}");
        }
    }
}
