//! The rendezvous store against clients that never authenticate: oversized greetings, idle
//! and half-sent connections by the thousand, a byte trickling in. They cost no thread and
//! no memory to speak of, peers with the secret still get in at once, and dropping the
//! server takes about a second at most.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use fsdp_comm::{StoreClient, StoreServer};

/// `Threads` and `VmRSS` (KiB) of this process.
fn threads_and_rss() -> (usize, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| -> usize {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap()
    };
    (field("Threads:"), field("VmRSS:"))
}

/// Raises this process's open-file limit to its hard limit (a thousand sockets on each
/// side need more than the usual 1024).
fn more_files() -> u64 {
    // SAFETY: plain getrlimit/setrlimit on this process.
    unsafe {
        let mut l: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        l.rlim_cur
    }
}

fn frame(len: u32, body: &[u8]) -> Vec<u8> {
    let mut v = len.to_le_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

/// What a hostile client could make an honest one wait is the 5 s greeting deadline; a
/// bound well under it shows they did not, and leaves a loaded 2-core machine room (the
/// honest case takes milliseconds).
const PROMPTLY: Duration = Duration::from_secs(4);

/// Whether the server closes `s` within `limit`.
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(n) => n == 0,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn oversized_greetings_are_refused_without_allocating() {
    let server = StoreServer::bind("127.0.0.1:0", b"secret").unwrap();
    let addr = server.local_addr();
    let (_, rss_before) = threads_and_rss();
    let mut conns = Vec::new();
    for _ in 0..6 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&frame(64 << 20, &[1u8; 10])).unwrap();
        conns.push(s);
    }
    // Refused at once: well inside the 5 s a greeting may take (the wait an oversized frame
    // must not get), with room for a loaded machine.
    for s in &mut conns {
        let started = Instant::now();
        assert!(closed_within(s, PROMPTLY));
        assert!(started.elapsed() < PROMPTLY);
    }
    let (_, rss_after) = threads_and_rss();
    assert!(
        rss_after < rss_before + (16 << 10),
        "RSS grew from {rss_before} to {rss_after} KiB"
    );
    let c = StoreClient::connect(
        "127.0.0.1",
        addr.port(),
        b"secret",
        0,
        Duration::from_secs(5),
    )
    .unwrap();
    c.set("k", b"v").unwrap();
}

#[test]
fn a_thousand_hostile_connections_cost_no_threads_and_hold_up_nobody() {
    let limit = more_files();
    let n = if limit >= 4096 { 1000 } else { 300 };
    let server = StoreServer::bind("127.0.0.1:0", b"secret").unwrap();
    let addr = server.local_addr();
    let (threads_before, rss_before) = threads_and_rss();
    let mut hostile = Vec::new();
    let connecting = Instant::now();
    for i in 0..n {
        let mut s = TcpStream::connect(addr).unwrap();
        match i % 10 {
            // Half a frame: a length, a few bytes, then silence.
            0 => s.write_all(&frame(2000, &[1u8; 7])).unwrap(),
            // Half a length.
            1 => s.write_all(&[5, 0]).unwrap(),
            // Idle.
            _ => {}
        }
        hostile.push(s);
    }
    eprintln!("{n} connections opened in {:?}", connecting.elapsed());
    // A byte every 100 ms: never a whole greeting.
    let mut trickle = TcpStream::connect(addr).unwrap();
    let trickler = std::thread::spawn(move || {
        let _ = trickle.write_all(&frame(1000, &[]));
        for _ in 0..80 {
            if trickle.write_all(&[0]).is_err() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    });
    std::thread::sleep(Duration::from_millis(300));
    let (threads, rss) = threads_and_rss();
    eprintln!(
        "{n} hostile connections: threads {threads_before} -> {threads}, RSS {rss_before} -> {rss} KiB"
    );
    // Other tests of this binary start and end threads meanwhile (a few); a thread per
    // hostile connection would add n.
    assert!(
        threads < threads_before + n / 10,
        "{n} hostile connections: threads {threads_before} -> {threads}"
    );
    assert!(rss < rss_before + (8 << 10), "{rss_before} -> {rss} KiB");

    // A peer with the secret gets in at once and works.
    let started = Instant::now();
    let c = StoreClient::connect(
        "127.0.0.1",
        addr.port(),
        b"secret",
        0,
        Duration::from_secs(10),
    )
    .unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k").unwrap(), Some(b"v".to_vec()));
    eprintln!("a peer authenticated in {:?}", started.elapsed());
    assert!(started.elapsed() < PROMPTLY);

    // The trickler is cut off by the greeting deadline.
    assert!(
        trickler.join().unwrap(),
        "a trickling client was kept past its deadline"
    );

    // Dropping the server returns promptly, whatever the hostile clients do.
    let started = Instant::now();
    drop(server);
    eprintln!("server dropped in {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_millis(1500));
    drop(hostile);
    drop(c);
}

#[test]
fn a_waiting_peer_is_answered_and_the_server_drops_within_a_second() {
    let server = StoreServer::bind("127.0.0.1:0", b"secret").unwrap();
    let port = server.local_addr().port();
    let c = StoreClient::connect("127.0.0.1", port, b"secret", 0, Duration::from_secs(5)).unwrap();
    let waiter = std::thread::spawn(move || c.wait(&["never".into()], Duration::from_secs(60)));
    // A peer sends half a request and stops.
    let c2 = StoreClient::connect("127.0.0.1", port, b"secret", 1, Duration::from_secs(5)).unwrap();
    drop(c2);
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    drop(server);
    assert!(started.elapsed() < Duration::from_millis(1500));
    // The waiter got its answer: the key is still missing.
    assert_eq!(
        waiter.join().unwrap().unwrap(),
        Err(vec!["never".to_string()])
    );
}
