//! The rendezvous store: a TCP key-value server hosted by rank 0 (or the launcher),
//! protected by a per-job secret, with set / get / wait / add / compare-and-set. Frames are a
//! little-endian u32 length and a payload; the first frame of a connection must present the
//! secret.

mod client;
mod server;

use std::io::Write;
use std::net::TcpStream;

pub use client::{StoreClient, Waited};
pub use server::StoreServer;

const OP_AUTH: u8 = 1;
const OP_SET: u8 = 2;
const OP_GET: u8 = 3;
const OP_WAIT: u8 = 4;
const OP_ADD: u8 = 5;
const OP_CAS: u8 = 6;
/// A wait that also ends when a stop key appears (a launcher stopping the job).
const OP_WAIT_UNLESS: u8 = 7;
const REPLY_OK: u8 = 0;
const REPLY_ERR: u8 = 1;
const REPLY_TIMEOUT: u8 = 2;
/// The stop key of an `OP_WAIT_UNLESS` appeared: its value follows.
const REPLY_STOPPED: u8 = 3;
/// Largest request or reply accepted from an authenticated peer.
const MAX_FRAME: usize = 64 << 20;

pub(super) fn ok_reply(fill: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = vec![REPLY_OK];
    fill(&mut out);
    out
}

pub(super) fn err_reply(msg: &str) -> Vec<u8> {
    let mut out = vec![REPLY_ERR];
    put_bytes(&mut out, Some(msg.as_bytes()));
    out
}

/// Compares secrets without an early exit, so timing does not reveal a matching prefix.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub(super) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Length-prefixed bytes; `None` is written as length `u32::MAX`.
pub(super) fn put_bytes(out: &mut Vec<u8>, v: Option<&[u8]>) {
    match v {
        Some(v) => {
            put_u32(out, v.len() as u32);
            out.extend_from_slice(v);
        }
        None => put_u32(out, u32::MAX),
    }
}

/// Reads the fields of a frame.
pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    pub(super) fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub(super) fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()))
    }
    pub(super) fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }
    pub(super) fn opt_bytes(&mut self) -> Option<Option<&'a [u8]>> {
        let n = self.u32()?;
        if n == u32::MAX {
            return Some(None);
        }
        self.take(n as usize).map(Some)
    }
    pub(super) fn bytes(&mut self) -> Option<&'a [u8]> {
        self.opt_bytes().flatten()
    }
    pub(super) fn string(&mut self) -> Option<String> {
        self.bytes()
            .and_then(|b| String::from_utf8(b.to_vec()).ok())
    }
}

pub(super) fn write_frame(stream: &mut TcpStream, payload: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    stream.write_all(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_wait_ends_when_its_stop_key_is_set() {
        let server = StoreServer::bind("127.0.0.1:0", b"s").unwrap();
        let port = server.local_addr().port();
        let t = Duration::from_secs(5);
        let c = StoreClient::connect("127.0.0.1", port, b"s", 0, t).unwrap();
        let keys = vec!["a".to_string(), "b".to_string()];
        c.set("a", b"").unwrap();
        let short = Duration::from_millis(100);
        assert_eq!(
            c.wait_unless(&keys, "stop", short).unwrap(),
            Waited::Missing(vec!["b".into()])
        );
        let c2 = StoreClient::connect("127.0.0.1", port, b"s", 1, t).unwrap();
        let started = std::time::Instant::now();
        let waiter = std::thread::spawn(move || c2.wait_unless(&keys, "stop", t).unwrap());
        std::thread::sleep(Duration::from_millis(50));
        c.set("stop", b"machine 1 failed").unwrap();
        assert_eq!(
            waiter.join().unwrap(),
            Waited::Stopped(b"machine 1 failed".to_vec())
        );
        assert!(started.elapsed() < Duration::from_secs(2));
        c.set("b", b"").unwrap();
        // Keys all set: ready, whatever the stop key says.
        assert_eq!(
            c.wait_unless(&["a".into(), "b".into()], "stop", short)
                .unwrap(),
            Waited::Ready
        );
    }

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
