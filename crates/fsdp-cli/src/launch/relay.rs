//! A worker's output, relayed as it comes: bytes go unchanged to its log file, and to the
//! console with `[rankN]: ` at the start of each line. Lines end at `\n` or `\r` (a progress
//! bar redrawing itself shows live), invalid UTF-8 passes through untouched, a line still
//! open when a read ends is written at once (no line is ever buffered whole) and ended
//! before another worker's output is written after it (its rest gets a new prefix), and the pipe
//! is drained to its end whatever happens to the console, so a worker never dies of a
//! closed pipe. The last lines are kept, decoded lossily, for the failure report.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Lines of each worker's output kept for the failure report.
const TAIL_LINES: usize = 20;
/// Longest line kept in the tail (the rest of it is cut).
const TAIL_LINE_BYTES: usize = 2048;
/// Bytes read from the pipe at a time.
const CHUNK: usize = 64 << 10;

/// The last lines of a worker's output.
#[derive(Default)]
pub(super) struct Tail {
    lines: VecDeque<String>,
    current: Vec<u8>,
}

impl Tail {
    fn push(&mut self, bytes: &[u8]) {
        for &b in bytes {
            match b {
                b'\n' => self.end_line(),
                // A carriage return redraws the line: what follows replaces it.
                b'\r' => self.current.clear(),
                _ if self.current.len() < TAIL_LINE_BYTES => self.current.push(b),
                _ => {}
            }
        }
    }

    fn end_line(&mut self) {
        if self.lines.len() == TAIL_LINES {
            self.lines.pop_front();
        }
        let line = String::from_utf8_lossy(&self.current).into_owned();
        self.lines.push_back(line);
        self.current.clear();
    }

    /// The kept lines, the unfinished one last.
    pub(super) fn lines(&self) -> Vec<String> {
        let mut out: Vec<String> = self.lines.iter().cloned().collect();
        if !self.current.is_empty() {
            out.push(String::from_utf8_lossy(&self.current).into_owned());
        }
        out
    }
}

/// Where a worker's stream goes.
pub(super) struct Route {
    /// The worker's rank (the console prefix).
    pub rank: usize,
    /// Whether the console shows it (`--local_ranks_filter`).
    pub show: bool,
    /// The launcher's standard error rather than its standard output.
    pub to_stderr: bool,
    /// The log file (`--log_dir`).
    pub log: Option<std::fs::File>,
    /// The worker's tail, shared by its streams.
    pub tail: Arc<Mutex<Tail>>,
}

/// A relay thread; `finished` says when it has drained its pipe.
pub(super) struct Relay {
    thread: std::thread::JoinHandle<()>,
    done: Receiver<()>,
}

impl Relay {
    /// Starts relaying `stream`.
    pub(super) fn start(stream: Box<dyn Read + Send>, route: Route) -> std::io::Result<Relay> {
        let (tx, done) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("fsdp-relay-{}", route.rank))
            .spawn(move || {
                relay(stream, route);
                let _ = tx.send(());
            })?;
        Ok(Relay { thread, done })
    }

    /// Waits until the pipe is drained or `deadline`; true when drained (the thread is then
    /// joined). A pipe held open by a process outside the launcher's reach is left behind.
    pub(super) fn finish(self, deadline: Instant) -> Option<Relay> {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.done.recv_timeout(left) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                let _ = self.thread.join();
                None
            }
            Err(RecvTimeoutError::Timeout) => Some(self),
        }
    }
}

/// The stream (rank, standard error or not) whose line is open on the console: written up
/// to a point without its end. Shared by every relay, and held while a segment is written,
/// so one worker's partial line is ended before another's output starts — lines never run
/// into each other — while a partial line (a progress bar) still shows at once.
static OPEN_LINE: Mutex<Option<(usize, bool)>> = Mutex::new(None);

/// Writes a message of the launcher's own to its standard error, every line prefixed
/// `[fsdp launch] `: an open worker line is ended first, and the message goes out whole
/// while no worker can write, so no worker output lands inside it.
pub(super) fn say(message: &str) {
    let mut open = OPEN_LINE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, to_stderr)) = open.take() {
        console_write(to_stderr, b"\n");
    }
    console_write(true, launcher_lines(message).as_bytes());
}

/// `message` with `[fsdp launch] ` before each of its lines, ending in a newline.
fn launcher_lines(message: &str) -> String {
    message
        .lines()
        .map(|line| format!("[fsdp launch] {line}\n"))
        .collect()
}

/// The console side: the prefix at each line start.
struct Console {
    rank: usize,
    prefix: Vec<u8>,
    to_stderr: bool,
}

/// Writes to the launcher's standard output or error; errors (a closed console) are
/// ignored: the pipe must still be drained.
fn console_write(to_stderr: bool, bytes: &[u8]) {
    if to_stderr {
        let mut e = std::io::stderr().lock();
        let _ = e.write_all(bytes);
        let _ = e.flush();
    } else {
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(bytes);
        let _ = o.flush();
    }
}

impl Console {
    fn me(&self) -> (usize, bool) {
        (self.rank, self.to_stderr)
    }

    fn write(&mut self, segment: &[u8]) {
        let mut open = OPEN_LINE.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::with_capacity(segment.len() + self.prefix.len() + 1);
        match *open {
            Some(me) if me == self.me() => {}
            Some((_, other_stderr)) => {
                // Another stream's line is open: end it (it continues under a new prefix).
                console_write(other_stderr, b"\n");
                out.extend_from_slice(&self.prefix);
            }
            None => out.extend_from_slice(&self.prefix),
        }
        out.extend_from_slice(segment);
        console_write(self.to_stderr, &out);
        *open = (!matches!(segment.last(), Some(b'\n' | b'\r'))).then(|| self.me());
    }

    /// Ends this stream's line if it is the open one (the worker's output ended inside it).
    fn close(&mut self) {
        let mut open = OPEN_LINE.lock().unwrap_or_else(|e| e.into_inner());
        if *open == Some(self.me()) {
            console_write(self.to_stderr, b"\n");
            *open = None;
        }
    }
}

fn relay(mut stream: Box<dyn Read + Send>, mut route: Route) {
    let mut console = Console {
        rank: route.rank,
        prefix: format!("[rank{}]: ", route.rank).into_bytes(),
        to_stderr: route.to_stderr,
    };
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let chunk = &buf[..n];
        if let Some(f) = route.log.as_mut() {
            let _ = f.write_all(chunk);
        }
        if route.show {
            // Each line ending closes a segment; what remains is written as it is, and
            // the line continues without a new prefix.
            for segment in chunk.split_inclusive(|b| *b == b'\n' || *b == b'\r') {
                console.write(segment);
            }
        }
        route
            .tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(chunk);
    }
    if route.show {
        console.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_keeps_the_last_lines_lossily_and_bounded() {
        let mut t = Tail::default();
        t.push(b"caf\xe9\nprogress 1%\rprogress 2%\r");
        t.push(b"done\n");
        for i in 0..30 {
            t.push(format!("line {i}\n").as_bytes());
        }
        t.push(&vec![b'x'; 10_000]);
        let lines = t.lines();
        assert_eq!(lines.len(), TAIL_LINES + 1);
        assert_eq!(lines[0], "line 10");
        assert_eq!(lines.last().unwrap().len(), TAIL_LINE_BYTES);
        let mut t = Tail::default();
        t.push(b"caf\xe9\nprogress 1%\rprogress 2%\rdone\n");
        assert_eq!(t.lines(), ["caf\u{fffd}", "done"]);
    }

    #[test]
    fn a_launcher_message_prefixes_each_of_its_lines() {
        assert_eq!(
            launcher_lines("rank 0 failed\nlast output:\n  error: x"),
            "[fsdp launch] rank 0 failed\n[fsdp launch] last output:\n[fsdp launch]   error: x\n"
        );
    }
}
