//! [`StoreClient`]: one connection to the store, requests serialised over it.

use std::io::Read;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{
    MAX_FRAME, OP_ADD, OP_AUTH, OP_CAS, OP_GET, OP_SET, OP_WAIT, OP_WAIT_UNLESS, REPLY_OK,
    REPLY_STOPPED, REPLY_TIMEOUT, Reader, put_bytes, put_u32, write_frame,
};
use crate::error::{CommError, Result};

/// A client of the store. Requests are serialised over one connection.
pub struct StoreClient {
    stream: Mutex<TcpStream>,
    rank: usize,
    timeout: Duration,
}

/// How a [`StoreClient::wait_unless`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Waited {
    /// Every key is set.
    Ready,
    /// The timeout passed: the keys still missing.
    Missing(Vec<String>),
    /// The stop key was set: its value.
    Stopped(Vec<u8>),
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
        let mut auth = vec![OP_AUTH];
        put_bytes(&mut auth, Some(secret));
        loop {
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
            // A store at its limit of unauthenticated connections closes new ones at once:
            // like a store not up yet, that is retried until the deadline.
            let outcome = attempt.and_then(|stream| {
                let _ = stream.set_nodelay(true);
                // A store host that vanishes fails requests within seconds, not minutes.
                crate::transport::enable_keepalive(&stream);
                // The greeting's reply must come by the deadline; later requests wait as
                // long as they need (a wait carries its own timeout).
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = stream.set_read_timeout(Some(left.max(Duration::from_secs(1))));
                let client = StoreClient {
                    stream: Mutex::new(stream),
                    rank,
                    timeout,
                };
                match client.request(&auth, "authenticating with the store") {
                    Ok(reply) => Ok((client, reply)),
                    Err(e) => Err(e.to_string()),
                }
            });
            match outcome {
                Ok((client, reply)) if reply.first() == Some(&REPLY_OK) => {
                    let _ = client
                        .stream
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .set_read_timeout(None);
                    return Ok(client);
                }
                Ok((_, reply)) => {
                    return Err(CommError::Refused {
                        rank,
                        reason: format!(
                            "the rendezvous store at {target} rejected this process: {}",
                            error_text(&reply)
                        ),
                    });
                }
                Err(e) if Instant::now() >= deadline => {
                    return Err(CommError::StoreUnreachable {
                        rank,
                        what: format!(
                            "connecting to the rendezvous store at {target} for {timeout:?}"
                        ),
                        message: e,
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
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

    /// Like [`StoreClient::wait`], but also ends as soon as `stop_key` is set: then
    /// `Stopped` with its value (a launcher stopping the job while ranks still join).
    pub fn wait_unless(
        &self,
        keys: &[String],
        stop_key: &str,
        timeout: Duration,
    ) -> Result<Waited> {
        let mut req = vec![OP_WAIT_UNLESS];
        put_u32(&mut req, keys.len() as u32);
        req.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
        put_bytes(&mut req, Some(stop_key.as_bytes()));
        for k in keys {
            put_bytes(&mut req, Some(k.as_bytes()));
        }
        let reply = self.request(&req, "wait")?;
        match reply.first() {
            Some(&REPLY_OK) => Ok(Waited::Ready),
            Some(&REPLY_STOPPED) => Ok(Waited::Stopped(
                Reader(&reply[1..])
                    .opt_bytes()
                    .flatten()
                    .unwrap_or_default()
                    .to_vec(),
            )),
            Some(&REPLY_TIMEOUT) => {
                let mut r = Reader(&reply[1..]);
                let n = r.u32().unwrap_or(0);
                Ok(Waited::Missing((0..n).filter_map(|_| r.string()).collect()))
            }
            _ => self.expect_ok(reply, "wait").map(|_| Waited::Ready),
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
