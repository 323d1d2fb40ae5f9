//! Which address of this host a rank listens on for its peers. `MASTER_ADDR` is machine 0's
//! address: a rank on another machine cannot listen there. Each rank listens on an address
//! of its own host that its peers reach — the one the route to `MASTER_ADDR` leaves by, or
//! the interface a variable names (`FSDP_SOCKET_IFNAME`, else `GLOO_SOCKET_IFNAME`, else
//! `NCCL_SOCKET_IFNAME`, as PyTorch's backends read them) — and publishes it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};

/// The variables naming the interface to listen on, strongest first.
pub const SOCKET_IFNAME_ENVS: [&str; 3] = [
    "FSDP_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
];

/// The address a rank listens on for its peers, and how it was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenAddress {
    /// The address.
    pub ip: IpAddr,
    /// How it was chosen, for `fsdp env` and messages (`the route to 10.0.0.1`,
    /// `GLOO_SOCKET_IFNAME=eth1`).
    pub chosen_by: String,
}

/// This host's interfaces with their addresses (IPv4 and IPv6), in the system's order.
pub fn interfaces() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list we free below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return out;
    }
    let mut at = list;
    while !at.is_null() {
        // SAFETY: `at` is a node of the list getifaddrs returned, valid until freeifaddrs.
        let ifa = unsafe { &*at };
        at = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr points to a sockaddr whose family says its real type.
        let ip = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))))
                }
                libc::AF_INET6 => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr)))
                }
                _ => None,
            }
        };
        if let Some(ip) = ip {
            out.push((name, ip));
        }
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(list) };
    out
}

/// The address of interface `spec` (comma-separated names or name prefixes, as NCCL takes
/// them; IPv4 preferred), from `interfaces`.
fn interface_address(spec: &str, interfaces: &[(String, IpAddr)]) -> Option<IpAddr> {
    let wanted: Vec<&str> = spec
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let matches = |name: &str| wanted.iter().any(|w| name == *w || name.starts_with(w));
    let found = |v4: bool| {
        interfaces
            .iter()
            .find(|(n, ip)| matches(n) && ip.is_ipv4() == v4)
            .map(|(_, ip)| *ip)
    };
    found(true).or_else(|| found(false))
}

/// The address of this host a rank listens on for peers in a job whose rendezvous is at
/// `master_addr:master_port` (see the module documentation); an error saying why none fits.
pub fn listen_address(master_addr: &str, master_port: u16) -> Result<ListenAddress, String> {
    for var in SOCKET_IFNAME_ENVS {
        let Some(spec) = crate::options::env_text(var)? else {
            continue;
        };
        if spec.trim().is_empty() {
            continue;
        }
        if spec.trim_start().starts_with('^') {
            return Err(format!(
                "{var}={spec}: excluding interfaces (`^`) is not supported; name the interface to use"
            ));
        }
        let all = interfaces();
        return match interface_address(&spec, &all) {
            Some(ip) => Ok(ListenAddress {
                ip,
                chosen_by: format!("{var}={spec}"),
            }),
            None => {
                let mut names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
                names.sort_unstable();
                names.dedup();
                Err(format!(
                    "{var}={spec}: no interface of that name has an address (this host has: {})",
                    names.join(", ")
                ))
            }
        };
    }
    let target: SocketAddr = (master_addr, master_port)
        .to_socket_addrs()
        .map_err(|e| format!("resolving MASTER_ADDR {master_addr}: {e}"))?
        .next()
        .ok_or_else(|| format!("MASTER_ADDR {master_addr} resolves to no address"))?;
    if target.ip().is_loopback() {
        return Ok(ListenAddress {
            ip: target.ip(),
            chosen_by: format!("MASTER_ADDR {master_addr} is this host's loopback"),
        });
    }
    // Connecting a UDP socket sends nothing: it only asks the kernel which local address
    // the route to the target leaves by.
    let unspecified: SocketAddr = match target {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let ip = UdpSocket::bind(unspecified)
        .and_then(|s| s.connect(target).map(|()| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| format!("no route to MASTER_ADDR {master_addr} ({target}): {e}"))?
        .ip();
    Ok(ListenAddress {
        ip,
        chosen_by: format!("the route to MASTER_ADDR {master_addr}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interface_is_found_by_name_or_prefix_ipv4_first() {
        let v6: IpAddr = "fe80::1".parse().unwrap();
        let v4: IpAddr = "10.9.0.2".parse().unwrap();
        let all = vec![
            ("lo".to_string(), IpAddr::V4(Ipv4Addr::LOCALHOST)),
            ("eth1".to_string(), v6),
            ("eth1".to_string(), v4),
        ];
        assert_eq!(interface_address("eth1", &all), Some(v4));
        assert_eq!(interface_address("ib0, eth", &all), Some(v4));
        assert_eq!(interface_address("wlan0", &all), None);
        // This host's loopback interface is listed.
        assert!(
            interfaces()
                .iter()
                .any(|(n, ip)| n == "lo" && ip.is_loopback())
        );
    }

    #[test]
    fn the_route_to_a_loopback_master_is_loopback() {
        let a = listen_address("127.0.0.1", 29500).unwrap();
        assert_eq!(a.ip, IpAddr::V4(Ipv4Addr::LOCALHOST));
        let a = listen_address("localhost", 29500).unwrap();
        assert!(a.ip.is_loopback());
    }
}
