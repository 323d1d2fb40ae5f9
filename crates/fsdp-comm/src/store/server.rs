//! [`StoreServer`]: the store's server. One thread greets every new connection without
//! blocking (a poll loop): an unknown client costs a socket and at most a greeting's bytes,
//! never a thread, and must present the secret within a few seconds in a frame no larger
//! than a greeting needs; only authenticated peers get a thread of their own. Dropping the
//! server answers waiting peers and returns within a second whatever clients do.

use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{
    MAX_FRAME, OP_ADD, OP_AUTH, OP_CAS, OP_GET, OP_SET, OP_WAIT, OP_WAIT_UNLESS, REPLY_OK,
    REPLY_STOPPED, REPLY_TIMEOUT, Reader, constant_time_eq, err_reply, ok_reply, put_bytes,
    put_u32, write_frame,
};

/// Largest greeting accepted from a client that has not authenticated: the operation and
/// the secret, nothing more, so an unknown client cannot make the server allocate.
const MAX_GREETING: usize = 4096;
/// Time a new client has to send its whole greeting (a trickle does not extend it).
const GREETING_DEADLINE: Duration = Duration::from_secs(5);
/// Connections greeted at once; a new one beyond this evicts the oldest (clients retry).
const MAX_GREETING_CONNECTIONS: usize = 512;
/// Connections the kernel queues before the greeter accepts them.
const ACCEPT_QUEUE: i32 = 1024;
/// Authenticated connections served at once.
const MAX_PEERS: usize = 4096;
/// Time an authenticated peer has to send a frame's bytes once it has sent their length.
const FRAME_DEADLINE: Duration = Duration::from_secs(30);
/// How long dropping the server waits for peer threads to answer and end.
const DRAIN_ON_DROP: Duration = Duration::from_secs(1);
/// How often blocked reads and the greeter look at the stop flag.
const POLL: Duration = Duration::from_millis(100);

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
}

struct Shared {
    state: Mutex<State>,
    /// Peer threads running; dropping the server waits a moment for them, so peers waiting
    /// on a key get their reply (the keys still missing) before this process goes away.
    peers: AtomicUsize,
    changed: Condvar,
    stop: AtomicBool,
    secret: Vec<u8>,
}

/// The store server. Serves until dropped.
pub struct StoreServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    greeter: Option<std::thread::JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves clients that present `secret`.
    pub fn bind(addr: impl ToSocketAddrs, secret: &[u8]) -> std::io::Result<StoreServer> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        // A deeper accept queue than std's 128, so a burst of connections (a flood, or a
        // thousand ranks) is not dropped while the greeter catches up. Linux applies a second
        // listen() to the open socket; failing that, the default stays.
        // SAFETY: listen on a socket this function owns.
        unsafe {
            libc::listen(listener.as_raw_fd(), ACCEPT_QUEUE);
        }
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            peers: AtomicUsize::new(0),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            secret: secret.to_vec(),
        });
        let s = shared.clone();
        let greeter = std::thread::Builder::new()
            .name("fsdp-store".into())
            .spawn(move || greet(listener, s))?;
        Ok(StoreServer {
            shared,
            addr,
            greeter: Some(greeter),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        if let Some(t) = self.greeter.take() {
            let _ = t.join();
        }
        // Waiters are answered at once on stop, and every read looks at the flag within
        // `POLL`: peer threads end quickly, and none may hold up this process for long.
        let deadline = Instant::now() + DRAIN_ON_DROP;
        while self.shared.peers.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A connection that has not authenticated yet.
struct Greeting {
    stream: TcpStream,
    /// The bytes of its first frame so far.
    bytes: Vec<u8>,
    deadline: Instant,
}

impl Greeting {
    /// Reads what has arrived, no more than the frame; `Some(true)` when the frame is
    /// complete, `None` when the client closed or sent more than a greeting may hold.
    fn read(&mut self) -> Option<bool> {
        loop {
            let want = match self.bytes.len() {
                n if n < 4 => 4 - n,
                n => {
                    let len = u32::from_le_bytes(self.bytes[..4].try_into().ok()?) as usize;
                    if len > MAX_GREETING {
                        return None;
                    }
                    let missing = 4 + len - n;
                    if missing == 0 {
                        return Some(true);
                    }
                    missing
                }
            };
            let mut chunk = [0u8; 512];
            let take = want.min(chunk.len());
            match self.stream.read(&mut chunk[..take]) {
                Ok(0) => return None,
                Ok(n) => self.bytes.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Some(false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
    }
}

/// The greeter: accepts connections, reads their greetings as they arrive, and hands the
/// authenticated ones to threads of their own.
fn greet(listener: TcpListener, shared: Arc<Shared>) {
    let mut waiting: VecDeque<Greeting> = VecDeque::new();
    while !shared.stop.load(Ordering::SeqCst) {
        let mut fds: Vec<libc::pollfd> = std::iter::once(listener.as_raw_fd())
            .chain(waiting.iter().map(|g| g.stream.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a valid array of pollfd for the duration of the call.
        unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                POLL.as_millis() as i32,
            );
        }
        let now = Instant::now();
        let mut keep = VecDeque::with_capacity(waiting.len());
        for (mut g, fd) in waiting.drain(..).zip(&fds[1..]) {
            if fd.revents == 0 {
                if g.deadline > now {
                    keep.push_back(g);
                }
                continue;
            }
            match g.read() {
                Some(true) => welcome(g, &shared),
                Some(false) if g.deadline > now => keep.push_back(g),
                _ => {}
            }
        }
        waiting = keep;
        if fds[0].revents != 0 {
            while let Ok((stream, _)) = listener.accept() {
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                if waiting.len() >= MAX_GREETING_CONNECTIONS {
                    waiting.pop_front();
                }
                waiting.push_back(Greeting {
                    stream,
                    bytes: Vec::new(),
                    deadline: now + GREETING_DEADLINE,
                });
            }
        }
    }
}

/// A complete greeting: an authenticated peer gets its reply and a thread; anyone else the
/// refusal, and the connection is closed.
fn welcome(g: Greeting, shared: &Arc<Shared>) {
    let mut stream = g.stream;
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    if !authenticates(&g.bytes[4..], &shared.secret) {
        let _ = write_frame(&mut stream, &err_reply("wrong or missing job secret"));
        return;
    }
    if shared.peers.load(Ordering::SeqCst) >= MAX_PEERS {
        let _ = write_frame(&mut stream, &err_reply("too many connections"));
        return;
    }
    if write_frame(&mut stream, &[REPLY_OK]).is_err() {
        return;
    }
    let _ = stream.set_write_timeout(None);
    shared.peers.fetch_add(1, Ordering::SeqCst);
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("fsdp-store-peer".into())
        .spawn(move || serve(stream, s));
    if spawned.is_err() {
        shared.peers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts a peer thread while it runs.
struct Counted<'a>(&'a AtomicUsize);

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An authenticated peer's requests, one at a time.
fn serve(mut stream: TcpStream, shared: Arc<Shared>) {
    let _running = Counted(&shared.peers);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(POLL));
    while let Some(req) = read_frame(&mut stream, &shared.stop) {
        if write_frame(&mut stream, &handle(&req, &shared)).is_err() {
            return;
        }
    }
}

/// Fills `buf` from `stream` (whose reads time out every `POLL`), giving up when the peer
/// closes, the server stops, or `deadline` passes.
fn read_full(
    stream: &mut TcpStream,
    buf: &mut [u8],
    stop: &AtomicBool,
    deadline: Option<Instant>,
) -> Option<()> {
    let mut got = 0;
    while got < buf.len() {
        if stop.load(Ordering::SeqCst) || deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        match stream.read(&mut buf[got..]) {
            Ok(0) => return None,
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return None,
        }
    }
    Some(())
}

/// One request: its length whenever it comes, its bytes within `FRAME_DEADLINE` of that.
fn read_frame(stream: &mut TcpStream, stop: &AtomicBool) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    read_full(stream, &mut len, stop, None)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return None;
    }
    let mut buf = vec![0u8; len];
    read_full(
        stream,
        &mut buf,
        stop,
        Some(Instant::now() + FRAME_DEADLINE),
    )?;
    Some(buf)
}

/// Whether a greeting presents the job's secret.
fn authenticates(greeting: &[u8], secret: &[u8]) -> bool {
    let mut r = Reader(greeting);
    r.u8() == Some(OP_AUTH) && r.bytes().is_some_and(|p| constant_time_eq(p, secret))
}

/// An authenticated peer's request, answered.
fn handle(req: &[u8], shared: &Shared) -> Vec<u8> {
    let mut r = Reader(req);
    let op = r.u8();
    let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
    match op {
        Some(OP_SET) => match (r.string(), r.bytes()) {
            (Some(k), Some(v)) => {
                state.map.insert(k, v.to_vec());
                shared.changed.notify_all();
                vec![REPLY_OK]
            }
            _ => err_reply("malformed set"),
        },
        Some(OP_GET) => match r.string() {
            Some(k) => match state.map.get(&k) {
                Some(v) => ok_reply(|o| put_bytes(o, Some(v))),
                None => ok_reply(|o| put_bytes(o, None)),
            },
            None => err_reply("malformed get"),
        },
        Some(op @ (OP_WAIT | OP_WAIT_UNLESS)) => {
            let (Some(n), Some(ms)) = (r.u32(), r.u64()) else {
                return err_reply("malformed wait");
            };
            let stop_key = match op {
                OP_WAIT_UNLESS => match r.string() {
                    Some(k) => Some(k),
                    None => return err_reply("malformed wait"),
                },
                _ => None,
            };
            let keys: Option<Vec<String>> = (0..n).map(|_| r.string()).collect();
            let Some(keys) = keys else {
                return err_reply("malformed wait");
            };
            let deadline = Instant::now() + Duration::from_millis(ms);
            loop {
                let missing: Vec<&String> = keys
                    .iter()
                    .filter(|k| !state.map.contains_key(*k))
                    .collect();
                if missing.is_empty() {
                    return vec![REPLY_OK];
                }
                if let Some(stop) = stop_key.as_ref().and_then(|k| state.map.get(k)) {
                    let mut out = vec![REPLY_STOPPED];
                    put_bytes(&mut out, Some(stop));
                    return out;
                }
                let now = Instant::now();
                if now >= deadline || shared.stop.load(Ordering::SeqCst) {
                    let mut out = vec![REPLY_TIMEOUT];
                    put_u32(&mut out, missing.len() as u32);
                    for k in missing {
                        put_bytes(&mut out, Some(k.as_bytes()));
                    }
                    return out;
                }
                let wait = (deadline - now).min(Duration::from_millis(200));
                state = shared
                    .changed
                    .wait_timeout(state, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        Some(OP_ADD) => match (r.string(), r.u64()) {
            (Some(k), Some(delta)) => {
                let current = state
                    .map
                    .get(&k)
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                    .unwrap_or(0);
                let new = current.wrapping_add(delta as i64);
                state.map.insert(k, new.to_string().into_bytes());
                shared.changed.notify_all();
                ok_reply(|o| o.extend_from_slice(&new.to_le_bytes()))
            }
            _ => err_reply("malformed add"),
        },
        Some(OP_CAS) => {
            let (Some(k), Some(has_expected)) = (r.string(), r.u8()) else {
                return err_reply("malformed compare_set");
            };
            let expected = if has_expected == 1 {
                r.bytes().map(<[u8]>::to_vec)
            } else {
                None
            };
            let Some(desired) = r.bytes() else {
                return err_reply("malformed compare_set");
            };
            let current = state.map.get(&k).cloned();
            if current == expected {
                state.map.insert(k, desired.to_vec());
                shared.changed.notify_all();
                ok_reply(|o| put_bytes(o, Some(desired)))
            } else {
                ok_reply(|o| put_bytes(o, current.as_deref()))
            }
        }
        _ => err_reply("unknown operation"),
    }
}
