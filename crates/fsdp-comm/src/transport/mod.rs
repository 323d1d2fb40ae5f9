//! Point-to-point links between the ranks of a group, over TCP. Each peer has a writer thread
//! (a send waits at most for the peer's reader, never for its caller, so ring steps cannot
//! deadlock) and a reader thread that files incoming frames per peer, or reads them straight
//! into receives posted for them; a lost connection or an abort from any peer wakes every
//! waiter at once, so failures surface in bounded time instead of hanging.

use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

mod inbox;

pub use inbox::{AlignedBytes, Frame, Inbox, Payload, RecvFailure};

/// Frame kinds.
pub const KIND_DATA: u8 = 1;
/// An abort: the payload is the sender's error message.
pub const KIND_ABORT: u8 = 2;

/// How long closing links waits for queued frames to be written.
const FLUSH_ON_CLOSE: Duration = Duration::from_secs(5);

/// The fixed header of every frame: what collective it belongs to, so ranks that disagree
/// are caught on the first message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// [`KIND_DATA`] or [`KIND_ABORT`].
    pub kind: u8,
    /// Collective kind.
    pub op: u8,
    /// Element type tag.
    pub dtype: u8,
    /// Reduction tag (0 when none).
    pub reduce: u8,
    /// Step inside the collective.
    pub step: u32,
    /// Which piece of the step's transfer this frame carries (large transfers travel as
    /// pieces, so the receiver copies one while the next is on the wire).
    pub part: u32,
    /// The collective's sequence number in its group.
    pub seq: u64,
    /// The collective's element count as called (the mismatch check compares it).
    pub count: u64,
    /// Payload bytes that follow.
    pub len: u64,
}

/// Bytes of an encoded header.
pub const HEADER_BYTES: usize = 40;
const MAGIC: u32 = 0x4653_4450; // "FSDP"

impl Header {
    /// The header's wire form.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind;
        b[5] = self.op;
        b[6] = self.dtype;
        b[7] = self.reduce;
        b[8..12].copy_from_slice(&self.step.to_le_bytes());
        b[12..16].copy_from_slice(&self.part.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.count.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses a wire header (`None` if the magic is wrong).
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Option<Header> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        (u32::from_le_bytes(b[0..4].try_into().unwrap_or_default()) == MAGIC).then(|| Header {
            kind: b[4],
            op: b[5],
            dtype: b[6],
            reduce: b[7],
            step: u32::from_le_bytes(b[8..12].try_into().unwrap_or_default()),
            part: u32::from_le_bytes(b[12..16].try_into().unwrap_or_default()),
            seq: u64_at(16),
            count: u64_at(24),
            len: u64_at(32),
        })
    }

    /// This collective's header for the frame of `step` and `part` carrying `len` bytes.
    pub fn frame(&self, step: u32, part: u32, len: usize) -> Header {
        Header {
            step,
            part,
            len: len as u64,
            ..*self
        }
    }

    /// Same collective (ignoring payload length).
    pub fn same_collective(&self, other: &Header) -> bool {
        (
            self.op,
            self.dtype,
            self.reduce,
            self.seq,
            self.count,
            self.step,
            self.part,
        ) == (
            other.op,
            other.dtype,
            other.reduce,
            other.seq,
            other.count,
            other.step,
            other.part,
        )
    }
}

/// What the writer thread sends.
enum Outgoing {
    /// A frame whose payload it owns.
    Frame(Header, Vec<u8>),
    /// A frame whose payload is the caller's bytes, lent until the lease is dropped.
    Lent {
        header: Header,
        payload: LentBytes,
        lease: Lease,
    },
    Close,
}

/// A payload lent to a writer thread.
struct LentBytes(*const u8, usize);

// SAFETY: the writer only reads the bytes, and [`Links::send_lent`]'s caller keeps them valid
// and unwritten until the lease is dropped.
unsafe impl Send for LentBytes {}

/// The payloads a transfer has lent to writer threads: per peer, how many are not yet
/// written (or dropped unwritten with a link that failed), and whether one was dropped
/// unwritten.
pub struct Leases {
    state: Mutex<LeaseState>,
    returned: Condvar,
}

struct LeaseState {
    out: Vec<usize>,
    unsent: Option<usize>,
}

/// One lent payload's share of [`Leases`]: returned when dropped, as written once the writer
/// has said so ([`Lease::written`]).
pub struct Lease {
    leases: Arc<Leases>,
    peer: usize,
    written: bool,
}

impl Leases {
    /// Leases for payloads lent to the links of a group of `size` ranks.
    pub fn new(size: usize) -> Arc<Leases> {
        Arc::new(Leases {
            state: Mutex::new(LeaseState {
                out: vec![0; size],
                unsent: None,
            }),
            returned: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LeaseState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A lease for one more payload lent to `peer`'s writer.
    pub fn lend(self: &Arc<Leases>, peer: usize) -> Lease {
        self.lock().out[peer] += 1;
        Lease {
            leases: self.clone(),
            peer,
            written: false,
        }
    }

    /// Waits until every lease is returned: `Ok(None)`, or `Ok(Some(peer))` if a payload
    /// lent to `peer` was dropped unwritten (its link failed); `Err(peer)` at `deadline`
    /// with a payload lent to `peer` still out.
    pub fn wait(&self, deadline: Option<Instant>) -> Result<Option<usize>, usize> {
        let (state, _) = wait_while(&self.returned, self.lock(), deadline, |s| {
            s.out.iter().any(|&n| n > 0)
        });
        match state.out.iter().position(|&n| n > 0) {
            Some(peer) => Err(peer),
            None => Ok(state.unsent),
        }
    }

    /// The peers whose writers still hold a lent payload.
    pub fn peers_out(&self) -> Vec<usize> {
        let state = self.lock();
        (0..state.out.len()).filter(|&p| state.out[p] > 0).collect()
    }
}

/// Waits on `cv` while `waiting` holds, until `deadline` (`None`: for as long as it takes);
/// returns the guard and whether `waiting` still holds.
pub(crate) fn wait_while<'a, T>(
    cv: &Condvar,
    guard: std::sync::MutexGuard<'a, T>,
    deadline: Option<Instant>,
    mut waiting: impl FnMut(&mut T) -> bool,
) -> (std::sync::MutexGuard<'a, T>, bool) {
    let mut guard = match deadline {
        None => cv
            .wait_while(guard, &mut waiting)
            .unwrap_or_else(|e| e.into_inner()),
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            match cv.wait_timeout_while(guard, left, &mut waiting) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            }
        }
    };
    let still = waiting(&mut guard);
    (guard, still)
}

impl Lease {
    /// The writer wrote the payload out.
    fn written(&mut self) {
        self.written = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut state = self.leases.lock();
        state.out[self.peer] -= 1;
        if !self.written {
            state.unsent.get_or_insert(self.peer);
        }
        drop(state);
        self.leases.returned.notify_all();
    }
}

/// The sending side of one peer link.
struct PeerWriter {
    tx: mpsc::Sender<Outgoing>,
    thread: Option<std::thread::JoinHandle<()>>,
    stream: TcpStream,
}

/// Links to every other rank of a group.
pub struct Links {
    writers: Vec<Option<PeerWriter>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    /// Incoming frames.
    pub inbox: Arc<Inbox>,
}

impl Links {
    /// Starts reader and writer threads over connected streams (`streams[me]` is `None`).
    pub fn start(streams: Vec<Option<TcpStream>>, name: &str) -> std::io::Result<Links> {
        let inbox = Arc::new(Inbox::new(streams.len()));
        let mut writers = Vec::new();
        let mut readers = Vec::new();
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                writers.push(None);
                continue;
            };
            stream.set_nodelay(true)?;
            enable_keepalive(&stream);
            let mut read_half = stream.try_clone()?;
            let inbox_r = inbox.clone();
            readers.push(
                std::thread::Builder::new()
                    .name(format!("{name}-rx{peer}"))
                    .spawn(move || {
                        read_frames(&mut read_half, peer, &inbox_r);
                        inbox_r.mark_lost(peer);
                    })?,
            );
            let (tx, rx) = mpsc::channel::<Outgoing>();
            let mut write_half = stream.try_clone()?;
            let inbox_w = inbox.clone();
            let thread = std::thread::Builder::new()
                .name(format!("{name}-tx{peer}"))
                .spawn(move || {
                    while let Ok(mut outgoing) = rx.recv() {
                        let written = match &outgoing {
                            Outgoing::Frame(header, payload) => {
                                write_frame(&mut write_half, header, payload)
                            }
                            // SAFETY: the lender keeps the bytes valid until the lease, held
                            // in `outgoing`, is dropped below.
                            Outgoing::Lent {
                                header,
                                payload: LentBytes(at, len),
                                ..
                            } => {
                                let payload = unsafe { std::slice::from_raw_parts(*at, *len) };
                                write_frame(&mut write_half, header, payload)
                            }
                            Outgoing::Close => return,
                        };
                        if let (Ok(()), Outgoing::Lent { lease, .. }) = (&written, &mut outgoing) {
                            lease.written();
                        }
                        drop(outgoing);
                        if written.is_err() {
                            // Dropping the receiver drops the frames still queued, returning
                            // their leases.
                            inbox_w.mark_lost(peer);
                            return;
                        }
                    }
                })?;
            writers.push(Some(PeerWriter {
                tx,
                thread: Some(thread),
                stream,
            }));
        }
        Ok(Links {
            writers,
            readers,
            inbox,
        })
    }

    /// Queues a frame for `peer`; returns false if the link is gone.
    pub fn send(&self, peer: usize, header: Header, payload: Vec<u8>) -> bool {
        match &self.writers[peer] {
            Some(w) => w.tx.send(Outgoing::Frame(header, payload)).is_ok(),
            None => false,
        }
    }

    /// Queues a frame for `peer` whose payload is `payload` itself, not a copy; returns false
    /// if the link is gone (the lease is then returned at once).
    ///
    /// # Safety
    /// `payload` must stay valid and unwritten until `lease` is dropped (its
    /// [`Leases::wait`] returns `Ok`).
    pub unsafe fn send_lent(
        &self,
        peer: usize,
        header: Header,
        payload: &[u8],
        lease: Lease,
    ) -> bool {
        let lent = LentBytes(payload.as_ptr(), payload.len());
        match &self.writers[peer] {
            Some(w) => {
                w.tx.send(Outgoing::Lent {
                    header,
                    payload: lent,
                    lease,
                })
                .is_ok()
            }
            None => false,
        }
    }

    /// Cuts the connection to `peer` both ways: its writer's and reader's blocked calls fail
    /// at once, which ends their use of lent payloads and posted receives. For a failed
    /// transfer whose peer stopped reading or sending mid-frame.
    pub fn cut(&self, peer: usize) {
        if let Some(w) = &self.writers[peer] {
            let _ = w.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Tells every peer this rank failed (best effort).
    pub fn broadcast_abort(&self, message: &str) {
        let header = Header {
            kind: KIND_ABORT,
            op: 0,
            dtype: 0,
            reduce: 0,
            step: 0,
            part: 0,
            seq: 0,
            count: 0,
            len: message.len() as u64,
        };
        for peer in 0..self.writers.len() {
            self.send(peer, header, message.as_bytes().to_vec());
        }
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        // Flush queued frames, then close so peers' readers see end of stream.
        // A peer that stopped reading must not block this process's exit: give writers a
        // bounded time to flush, then cut the connection (which unblocks them).
        for w in self.writers.iter_mut().flatten() {
            let _ = w.tx.send(Outgoing::Close);
        }
        let deadline = Instant::now() + FLUSH_ON_CLOSE;
        for w in self.writers.iter_mut().flatten() {
            while w.thread.as_ref().is_some_and(|t| !t.is_finished()) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            let _ = w.stream.shutdown(std::net::Shutdown::Both);
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

/// How long data sent to a peer may stay unacknowledged before its connection is declared
/// lost (`TCP_USER_TIMEOUT`): keepalive probes only an idle connection, so a host that
/// vanishes while a transfer is in flight would otherwise be retransmitted to for about 15
/// minutes.
const UNACKNOWLEDGED_MS: libc::c_int = 10_000;

/// Probes an idle connection after 5 s, every 2 s, 3 times, and gives data in flight 10 s
/// to be acknowledged: a peer whose host vanished without closing the connection is
/// declared lost within about 11 s, idle or mid-transfer.
pub(crate) fn enable_keepalive(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| {
        // SAFETY: setting an integer socket option on a socket we own.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 5);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 2);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, UNACKNOWLEDGED_MS);
}

/// Writes one frame, header and payload in as few calls as the socket takes.
fn write_frame(stream: &mut TcpStream, header: &Header, payload: &[u8]) -> std::io::Result<()> {
    let head = header.encode();
    let mut written = 0;
    let total = HEADER_BYTES + payload.len();
    while written < total {
        let n = if written < HEADER_BYTES {
            stream.write_vectored(&[IoSlice::new(&head[written..]), IoSlice::new(payload)])?
        } else {
            stream.write(&payload[written - HEADER_BYTES..])?
        };
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        written += n;
    }
    Ok(())
}

/// `peer`'s reader: files each frame in the inbox until the connection ends, reading a data
/// frame's payload straight into the receive posted for it where there is one.
fn read_frames(stream: &mut TcpStream, peer: usize, inbox: &Inbox) {
    loop {
        let mut hb = [0u8; HEADER_BYTES];
        if stream.read_exact(&mut hb).is_err() {
            return;
        }
        let Some(header) = Header::decode(&hb) else {
            return;
        };
        let Ok(len) = usize::try_from(header.len) else {
            return;
        };
        if header.kind == KIND_DATA
            && let Some(dst) = inbox.claim(peer, &header)
        {
            // SAFETY: the posting's owner keeps `dst` valid for the header's `len` bytes and
            // untouched until this frame lands or its withdrawal returns, which waits for
            // `landed` below.
            let payload = unsafe { std::slice::from_raw_parts_mut(dst, len) };
            let ok = stream.read_exact(payload).is_ok();
            inbox.landed(peer, header, ok);
            if !ok {
                return;
            }
            continue;
        }
        let mut payload = AlignedBytes::zeroed(len);
        if stream.read_exact(payload.as_mut_slice()).is_err() {
            return;
        }
        inbox.push(
            peer,
            Frame {
                header,
                payload: Payload::Bytes(payload),
            },
        );
    }
}

#[cfg(test)]
mod tests;
