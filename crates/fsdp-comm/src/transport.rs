//! Point-to-point links between the ranks of a group, over TCP. Each peer has a writer thread
//! (sends never block the caller, so ring steps cannot deadlock) and a reader thread that
//! files incoming frames per peer; a lost connection or an abort from any peer wakes every
//! waiter at once, so failures surface in bounded time instead of hanging.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

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

/// A received frame.
pub struct Frame {
    /// Its header.
    pub header: Header,
    /// Its payload.
    pub payload: AlignedBytes,
}

/// Bytes stored 8-byte aligned, so a payload can be read as any element type in place.
pub struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    /// Zeroed bytes.
    pub fn zeroed(len: usize) -> AlignedBytes {
        AlignedBytes {
            words: vec![0u64; len.div_ceil(8)],
            len,
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }
}

/// Why a receive did not produce a frame.
pub enum RecvFailure {
    /// The connection to the peer closed.
    Lost,
    /// A peer sent an abort: (origin group rank, message).
    Aborted(usize, String),
    /// Nothing arrived in time.
    Timeout,
}

#[derive(Default)]
struct InboxState {
    queues: Vec<VecDeque<Frame>>,
    lost: Vec<bool>,
    abort: Option<(usize, String)>,
}

/// Incoming frames of every peer, and the failures seen so far.
pub struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
    /// Also called when a peer is lost or an abort arrives (wakes a shared-memory waiter).
    waker: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Inbox {
    fn new(size: usize) -> Inbox {
        Inbox {
            state: Mutex::new(InboxState {
                queues: (0..size).map(|_| VecDeque::new()).collect(),
                lost: vec![false; size],
                abort: None,
            }),
            arrived: Condvar::new(),
            waker: std::sync::OnceLock::new(),
        }
    }

    /// Installs a callback run whenever a peer is lost or an abort arrives.
    pub fn set_waker(&self, waker: Box<dyn Fn() + Send + Sync>) {
        let _ = self.waker.set(waker);
    }

    /// True once the connection to `peer` has closed.
    pub fn is_lost(&self, peer: usize) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).lost[peer]
    }

    /// The first abort received over the links, if any: (origin, message).
    pub fn abort_received(&self) -> Option<(usize, String)> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .abort
            .clone()
    }

    fn wake(&self) {
        if let Some(w) = self.waker.get() {
            w();
        }
    }

    /// The next frame from `peer`, waiting up to `timeout`. Frames already queued are
    /// delivered before an abort or loss is reported.
    pub fn recv(&self, peer: usize, timeout: Duration) -> Result<Frame, RecvFailure> {
        let deadline = Instant::now() + timeout;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(frame) = state.queues[peer].pop_front() {
                return Ok(frame);
            }
            if let Some((origin, msg)) = &state.abort {
                return Err(RecvFailure::Aborted(*origin, msg.clone()));
            }
            if state.lost[peer] {
                return Err(RecvFailure::Lost);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RecvFailure::Timeout);
            }
            state = self
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn push(&self, peer: usize, frame: Frame) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if frame.header.kind == KIND_ABORT {
            if state.abort.is_none() {
                let msg = String::from_utf8_lossy(frame.payload.as_slice()).into_owned();
                state.abort = Some((peer, msg));
            }
            drop(state);
            self.wake();
            self.arrived.notify_all();
            return;
        }
        state.queues[peer].push_back(frame);
        self.arrived.notify_all();
    }

    fn mark_lost(&self, peer: usize) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.lost[peer] = true;
        drop(state);
        self.wake();
        self.arrived.notify_all();
    }
}

/// What the writer thread sends.
enum Outgoing {
    Frame(Header, Vec<u8>),
    Close,
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
                        while let Some(frame) = read_frame(&mut read_half) {
                            inbox_r.push(peer, frame);
                        }
                        inbox_r.mark_lost(peer);
                    })?,
            );
            let (tx, rx) = mpsc::channel::<Outgoing>();
            let mut write_half = stream.try_clone()?;
            let inbox_w = inbox.clone();
            let thread = std::thread::Builder::new()
                .name(format!("{name}-tx{peer}"))
                .spawn(move || {
                    while let Ok(Outgoing::Frame(header, payload)) = rx.recv() {
                        let ok = write_half.write_all(&header.encode()).is_ok()
                            && write_half.write_all(&payload).is_ok();
                        if !ok {
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

fn read_frame(stream: &mut TcpStream) -> Option<Frame> {
    let mut hb = [0u8; HEADER_BYTES];
    stream.read_exact(&mut hb).ok()?;
    let header = Header::decode(&hb)?;
    let mut payload = AlignedBytes::zeroed(usize::try_from(header.len).ok()?);
    stream.read_exact(payload.as_mut_slice()).ok()?;
    Some(Frame { header, payload })
}
