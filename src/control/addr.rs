//! Addresses the engine advertises and the port its RPC server binds.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs};

use crate::error::{Error, Result};

/// The IP peers should use: `hostname` resolved (IPv4 preferred) when given, else the address of
/// the interface that carries the default route, else the first non-loopback IPv4 address, else
/// 127.0.0.1.
pub fn advertised_ip(hostname: &str) -> Result<IpAddr> {
    let hostname = hostname.trim();
    if !hostname.is_empty() {
        let bare = hostname.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Ok(ip);
        }
        let addrs: Vec<SocketAddr> = (bare, 0)
            .to_socket_addrs()
            .map_err(|e| Error::InvalidArgument(format!("cannot resolve rpc_server_hostname {hostname:?}: {e}")))?
            .collect();
        return addrs
            .iter()
            .find(|a| a.is_ipv4())
            .or_else(|| addrs.first())
            .map(|a| a.ip())
            .ok_or_else(|| Error::InvalidArgument(format!("rpc_server_hostname {hostname:?} has no address")));
    }
    let ifaces = interface_addrs();
    if let Some(dev) = default_route_interface() {
        if let Some((_, ip)) = ifaces.iter().find(|(name, ip)| *name == dev && ip.is_ipv4()) {
            return Ok(*ip);
        }
    }
    Ok(ifaces
        .iter()
        .find(|(name, ip)| name != "lo" && ip.is_ipv4() && !ip.is_loopback())
        .map(|(_, ip)| *ip)
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

/// Splits `host:port` into its host and port as upstream splits a server name: `[v6]:port`,
/// `[v6]`, `host:port` or `host` (a bare IPv6 address is all host). A missing or unreadable port
/// is `None`.
pub fn split_host_port(name: &str) -> (String, Option<u16>) {
    let name = name.trim();
    if let Some(rest) = name.strip_prefix('[') {
        if let Some((host, tail)) = rest.split_once(']') {
            return (host.to_string(), tail.strip_prefix(':').and_then(|p| p.parse().ok()));
        }
    }
    match name.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => (host.to_string(), port.parse().ok()),
        _ => (name.to_string(), None),
    }
}

/// Formats `ip:port`, bracketing IPv6 addresses.
pub fn host_port(ip: &IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}:{port}"),
        IpAddr::V6(v6) => format!("[{v6}]:{port}"),
    }
}

/// Binds the RPC listener on all interfaces. Port 0 picks a free port in [15000, 17000) as
/// upstream does; an explicit port that is taken is an error (upstream silently moves).
pub fn bind_rpc_listener(port: u16, ipv6: bool) -> Result<TcpListener> {
    let any: IpAddr = if ipv6 {
        "::".parse().unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    };
    if port != 0 {
        return TcpListener::bind(SocketAddr::new(any, port))
            .map_err(|e| Error::InvalidArgument(format!("rpc_server_port {port} cannot be bound: {e}")));
    }
    // Start at a pseudo-random point so engines started together rarely collide.
    let seed = (std::process::id() as u64).wrapping_mul(2_654_435_761).wrapping_add(now_nanos());
    let span = 2000u64;
    let mut last_err = None;
    for i in 0..span {
        let candidate = 15000 + ((seed + i * 7919) % span) as u16;
        match TcpListener::bind(SocketAddr::new(any, candidate)) {
            Ok(l) => return Ok(l),
            Err(e) => last_err = Some(e),
        }
    }
    let errno = last_err.as_ref().and_then(|e| e.raw_os_error()).unwrap_or(libc::EADDRINUSE);
    Err(Error::os(
        errno,
        format!("no free RPC port in [15000, 17000): {}", last_err.map(|e| e.to_string()).unwrap_or_default()),
    ))
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// The interface of the default IPv4 route, read from /proc/net/route.
fn default_route_interface() -> Option<String> {
    let text = std::fs::read_to_string("/proc/net/route").ok()?;
    text.lines().skip(1).find_map(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        (cols.len() > 2 && cols[1] == "00000000").then(|| cols[0].to_string())
    })
}

/// Every (interface name, address) pair from getifaddrs.
fn interface_addrs() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: cur is a node of the list returned by getifaddrs, valid until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: ifa_addr is non-NULL; sa_family tells which sockaddr type it points to.
        let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: family AF_INET means the address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: family AF_INET6 means the address is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::V6(std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        out.push((name, ip));
    }
    // SAFETY: head came from getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(head) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_hostname_wins() {
        assert_eq!(advertised_ip("127.0.0.1").unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)).to_string(), "127.0.0.1");
        assert!(advertised_ip("256.256.256.256").is_err());
    }

    #[test]
    fn ipv6_is_bracketed() {
        let ip: IpAddr = "::1".parse().expect("literal");
        assert_eq!(host_port(&ip, 15000), "[::1]:15000");
        assert_eq!(host_port(&IpAddr::V4(Ipv4Addr::LOCALHOST), 1), "127.0.0.1:1");
    }

    #[test]
    fn random_port_is_in_upstream_range_and_explicit_taken_port_fails() {
        let l = bind_rpc_listener(0, false).expect("a free port");
        let port = l.local_addr().expect("bound").port();
        assert!((15000..17000).contains(&port));
        assert!(bind_rpc_listener(port, false).is_err());
    }
}
