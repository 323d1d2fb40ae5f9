//! The rendezvous store: a TCP key-value server hosted by rank 0, protected by a per-job
//! secret, with set / get / wait / add / compare-and-set.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};

const OP_AUTH: u8 = 1;
const OP_SET: u8 = 2;
const OP_GET: u8 = 3;
const OP_WAIT: u8 = 4;
const OP_ADD: u8 = 5;
const OP_CAS: u8 = 6;
const REPLY_OK: u8 = 0;
const REPLY_ERR: u8 = 1;
const REPLY_TIMEOUT: u8 = 2;
/// Largest request or reply accepted, so a stray client cannot make the server allocate
/// without bound.
const MAX_FRAME: usize = 64 << 20;

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
}

struct Shared {
    state: Mutex<State>,
    /// Connection threads, joined on drop so clients waiting on a key get their reply
    /// (the keys still missing) before this process goes away.
    connections: Mutex<Vec<std::thread::JoinHandle<()>>>,
    changed: Condvar,
    stop: AtomicBool,
    secret: Vec<u8>,
}

/// The store server. Serves until dropped.
pub struct StoreServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept_thread: Option<std::thread::JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves clients that present `secret`.
    pub fn bind(addr: impl ToSocketAddrs, secret: &[u8]) -> std::io::Result<StoreServer> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            connections: Mutex::new(Vec::new()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            secret: secret.to_vec(),
        });
        let s = shared.clone();
        let accept_thread = std::thread::Builder::new()
            .name("fsdp-store".into())
            .spawn(move || accept_loop(listener, s))?;
        Ok(StoreServer {
            shared,
            addr,
            accept_thread: Some(accept_thread),
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
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        // Waiters are answered at once on stop; idle connections notice within 200 ms.
        let connections = std::mem::take(
            &mut *self
                .shared
                .connections
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for c in connections {
            let _ = c.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let s = shared.clone();
                if let Ok(handle) = std::thread::Builder::new()
                    .name("fsdp-store-conn".into())
                    .spawn(move || serve(stream, s))
                {
                    shared
                        .connections
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(handle);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn serve(mut stream: TcpStream, shared: Arc<Shared>) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    // Idle connections are polled so the server can stop.
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut authed = false;
    loop {
        let req = match read_frame_polling(&mut stream, &shared.stop) {
            Some(r) => r,
            None => return,
        };
        let reply = handle(&req, &shared, &mut authed);
        let close = !authed;
        if write_frame(&mut stream, &reply).is_err() || close {
            return;
        }
    }
}

fn read_frame_polling(stream: &mut TcpStream, stop: &AtomicBool) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        if stop.load(Ordering::SeqCst) {
            return None;
        }
        match stream.read(&mut len[got..]) {
            Ok(0) => return None,
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return None,
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return None;
    }
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf = vec![0u8; len];
    let ok = stream.read_exact(&mut buf).is_ok();
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    ok.then_some(buf)
}

fn handle(req: &[u8], shared: &Shared, authed: &mut bool) -> Vec<u8> {
    let mut r = Reader(req);
    let op = r.u8();
    if !*authed {
        let presented = r.bytes();
        if op == Some(OP_AUTH) && presented.is_some_and(|p| constant_time_eq(p, &shared.secret)) {
            *authed = true;
            return vec![REPLY_OK];
        }
        return err_reply("wrong or missing job secret");
    }
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
        Some(OP_WAIT) => {
            let (Some(n), Some(ms)) = (r.u32(), r.u64()) else {
                return err_reply("malformed wait");
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

fn ok_reply(fill: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = vec![REPLY_OK];
    fill(&mut out);
    out
}

fn err_reply(msg: &str) -> Vec<u8> {
    let mut out = vec![REPLY_ERR];
    put_bytes(&mut out, Some(msg.as_bytes()));
    out
}

/// Compares secrets without an early exit, so timing does not reveal a matching prefix.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Length-prefixed bytes; `None` is written as length `u32::MAX`.
fn put_bytes(out: &mut Vec<u8>, v: Option<&[u8]>) {
    match v {
        Some(v) => {
            put_u32(out, v.len() as u32);
            out.extend_from_slice(v);
        }
        None => put_u32(out, u32::MAX),
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }
    fn opt_bytes(&mut self) -> Option<Option<&'a [u8]>> {
        let n = self.u32()?;
        if n == u32::MAX {
            return Some(None);
        }
        self.take(n as usize).map(Some)
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        self.opt_bytes().flatten()
    }
    fn string(&mut self) -> Option<String> {
        self.bytes()
            .and_then(|b| String::from_utf8(b.to_vec()).ok())
    }
}

fn write_frame(stream: &mut TcpStream, payload: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    stream.write_all(&buf)
}

/// A client of the store. Requests are serialised over one connection.
pub struct StoreClient {
    stream: Mutex<TcpStream>,
    rank: usize,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to the store at `addr`, retrying until `timeout` (rank 0 may not be up yet),
    /// and presents `secret`.
    pub fn connect(
        addr: &str,
        port: u16,
        secret: &[u8],
        rank: usize,
        timeout: Duration,
    ) -> Result<StoreClient> {
        let deadline = Instant::now() + timeout;
        let target = format!("{addr}:{port}");
        let stream = loop {
            let attempt = target
                .to_socket_addrs()
                .map_err(|e| e.to_string())
                .and_then(|mut a| {
                    a.next()
                        .ok_or_else(|| "address did not resolve".to_string())
                })
                .and_then(|a| {
                    TcpStream::connect_timeout(&a, Duration::from_secs(2))
                        .map_err(|e| e.to_string())
                });
            match attempt {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(CommError::Io {
                        rank,
                        what: format!(
                            "connecting to the rendezvous store at {target} for {timeout:?}"
                        ),
                        message: e,
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let _ = stream.set_nodelay(true);
        let client = StoreClient {
            stream: Mutex::new(stream),
            rank,
            timeout,
        };
        let mut req = vec![OP_AUTH];
        put_bytes(&mut req, Some(secret));
        let reply = client.request(&req, "authenticating with the store")?;
        if reply.first() != Some(&REPLY_OK) {
            return Err(CommError::Refused {
                rank,
                reason: format!(
                    "the rendezvous store at {target} rejected this process: {}",
                    error_text(&reply)
                ),
            });
        }
        Ok(client)
    }

    fn request(&self, req: &[u8], what: &str) -> Result<Vec<u8>> {
        let io = |e: std::io::Error| CommError::Io {
            rank: self.rank,
            what: format!("store request ({what})"),
            message: e.to_string(),
        };
        let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut stream, req).map_err(io)?;
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).map_err(io)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_FRAME {
            return Err(io(std::io::Error::other("oversized reply")));
        }
        let mut buf = vec![0u8; len];
        stream.read_exact(&mut buf).map_err(io)?;
        Ok(buf)
    }

    fn expect_ok(&self, reply: Vec<u8>, what: &str) -> Result<Vec<u8>> {
        match reply.first() {
            Some(&REPLY_OK) => Ok(reply[1..].to_vec()),
            _ => Err(CommError::Refused {
                rank: self.rank,
                reason: format!("store {what}: {}", error_text(&reply)),
            }),
        }
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = vec![OP_SET];
        put_bytes(&mut req, Some(key.as_bytes()));
        put_bytes(&mut req, Some(value));
        let reply = self.request(&req, "set")?;
        self.expect_ok(reply, "set").map(|_| ())
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let mut req = vec![OP_GET];
        put_bytes(&mut req, Some(key.as_bytes()));
        let reply = self.request(&req, "get")?;
        let body = self.expect_ok(reply, "get")?;
        Ok(Reader(&body).opt_bytes().flatten().map(<[u8]>::to_vec))
    }

    /// Waits until every key is set; on timeout returns the keys still missing.
    pub fn wait(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Result<std::result::Result<(), Vec<String>>> {
        let mut req = vec![OP_WAIT];
        put_u32(&mut req, keys.len() as u32);
        req.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
        for k in keys {
            put_bytes(&mut req, Some(k.as_bytes()));
        }
        let reply = self.request(&req, "wait")?;
        match reply.first() {
            Some(&REPLY_OK) => Ok(Ok(())),
            Some(&REPLY_TIMEOUT) => {
                let mut r = Reader(&reply[1..]);
                let n = r.u32().unwrap_or(0);
                Ok(Err((0..n).filter_map(|_| r.string()).collect()))
            }
            _ => self.expect_ok(reply, "wait").map(|_| Ok(())),
        }
    }

    /// Atomically adds `delta` to the integer at `key` (0 if unset); returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = vec![OP_ADD];
        put_bytes(&mut req, Some(key.as_bytes()));
        req.extend_from_slice(&delta.to_le_bytes());
        let reply = self.request(&req, "add")?;
        let body = self.expect_ok(reply, "add")?;
        Ok(Reader(&body).u64().unwrap_or(0) as i64)
    }

    /// Sets `key` to `desired` if its value equals `expected` (`None`: unset). Returns the
    /// value after the operation: `desired` on success, the current value otherwise.
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        let mut req = vec![OP_CAS];
        put_bytes(&mut req, Some(key.as_bytes()));
        match expected {
            Some(e) => {
                req.push(1);
                put_bytes(&mut req, Some(e));
            }
            None => req.push(0),
        }
        put_bytes(&mut req, Some(desired));
        let reply = self.request(&req, "compare_set")?;
        let body = self.expect_ok(reply, "compare_set")?;
        Ok(Reader(&body).opt_bytes().flatten().map(<[u8]>::to_vec))
    }

    /// The default timeout this client was created with.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

fn error_text(reply: &[u8]) -> String {
    Reader(reply.get(1..).unwrap_or_default())
        .string()
        .unwrap_or_else(|| "connection closed".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_and_secret() {
        let server = StoreServer::bind("127.0.0.1:0", b"s3cret").unwrap();
        let port = server.local_addr().port();
        let t = Duration::from_secs(5);
        let c = StoreClient::connect("127.0.0.1", port, b"s3cret", 0, t).unwrap();
        c.set("a", b"1").unwrap();
        assert_eq!(c.get("a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(c.get("b").unwrap(), None);
        assert_eq!(c.add("n", 5).unwrap(), 5);
        assert_eq!(c.add("n", -2).unwrap(), 3);
        assert_eq!(c.compare_set("k", None, b"x").unwrap(), Some(b"x".to_vec()));
        assert_eq!(c.compare_set("k", None, b"y").unwrap(), Some(b"x".to_vec()));
        assert_eq!(
            c.compare_set("k", Some(b"x"), b"z").unwrap(),
            Some(b"z".to_vec())
        );
        assert_eq!(c.wait(&["a".into()], t).unwrap(), Ok(()));
        let missing = c
            .wait(&["a".into(), "nope".into()], Duration::from_millis(100))
            .unwrap();
        assert_eq!(missing, Err(vec!["nope".to_string()]));

        // A waiter is woken by another client's set.
        let c2 = StoreClient::connect("127.0.0.1", port, b"s3cret", 1, t).unwrap();
        let waiter =
            std::thread::spawn(move || c2.wait(&["late".into()], Duration::from_secs(5)).unwrap());
        std::thread::sleep(Duration::from_millis(50));
        c.set("late", b"").unwrap();
        assert_eq!(waiter.join().unwrap(), Ok(()));

        let err = StoreClient::connect("127.0.0.1", port, b"wrong", 2, t)
            .err()
            .unwrap();
        assert!(
            err.to_string()
                .contains("rejected this process: wrong or missing job secret"),
            "{err}"
        );
    }
}
