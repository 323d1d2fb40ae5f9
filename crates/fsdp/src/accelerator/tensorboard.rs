//! TensorBoard event files, written as TensorFlow's summary writers do (what PyTorch's
//! `SummaryWriter` behind Accelerate's `log_with="tensorboard"` writes): a TFRecord stream of
//! `Event` protocol buffers, the first holding the file version, each later one a step's
//! scalars (`simple_value`) or a text summary (the text plugin's string tensor). Only the
//! few protobuf fields these need are encoded, by hand (no protobuf dependency).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// TFRecord's masked CRC (a CRC of data holding CRCs is otherwise weak).
fn masked_crc(bytes: &[u8]) -> u32 {
    // CRC-32C (Castagnoli), the checksum of TFRecord frames.
    let c = crc32c::crc32c(bytes);
    (c.rotate_right(15)).wrapping_add(0xA282_EAD8)
}

/// Protocol-buffer encoding of the few field kinds an `Event` needs.
#[derive(Default)]
struct Proto(Vec<u8>);

impl Proto {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }
    fn key(&mut self, field: u32, wire: u8) {
        self.varint(((field as u64) << 3) | wire as u64);
    }
    fn double(mut self, field: u32, v: f64) -> Self {
        self.key(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn float(mut self, field: u32, v: f32) -> Self {
        self.key(field, 5);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn int(mut self, field: u32, v: u64) -> Self {
        self.key(field, 0);
        self.varint(v);
        self
    }
    fn bytes(mut self, field: u32, v: &[u8]) -> Self {
        self.key(field, 2);
        self.varint(v.len() as u64);
        self.0.extend_from_slice(v);
        self
    }
    fn message(self, field: u32, m: Proto) -> Self {
        self.bytes(field, &m.0)
    }
}

/// TensorFlow's `DataType` of a string tensor (`DT_STRING`).
const DT_STRING: u64 = 7;

/// One TensorBoard event file: `events.out.tfevents.<seconds>.<host>.<pid>` in a folder,
/// appended to and flushed after every event (a run that dies keeps what it logged).
pub(crate) struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates the folder and a new event file in it, starting with the file version.
    pub(crate) fn create(dir: &Path) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let now = wall_time();
        let host = super::host_name().unwrap_or_else(|| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now as u64,
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)?;
        let mut writer = EventWriter {
            file: BufWriter::new(file),
            path,
        };
        writer.event(Proto::default().double(1, now).bytes(3, b"brain.Event:2"))?;
        Ok(writer)
    }

    /// The event file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// One event with `scalars` (tag, value) at `step`.
    pub(crate) fn scalars(&mut self, step: u64, scalars: &[(String, f32)]) -> std::io::Result<()> {
        let mut summary = Proto::default();
        for (tag, value) in scalars {
            summary = summary.message(
                1,
                Proto::default().bytes(1, tag.as_bytes()).float(2, *value),
            );
        }
        self.summary(step, summary)
    }

    /// One text summary (TensorBoard's Text tab, Markdown) named `tag` at `step`.
    pub(crate) fn text(&mut self, step: u64, tag: &str, text: &str) -> std::io::Result<()> {
        let plugin = Proto::default().bytes(1, b"text");
        let tensor = Proto::default()
            .int(1, DT_STRING)
            .message(2, Proto::default())
            .bytes(8, text.as_bytes());
        let value = Proto::default()
            .bytes(1, tag.as_bytes())
            .message(9, Proto::default().message(1, plugin))
            .message(8, tensor);
        self.summary(step, Proto::default().message(1, value))
    }

    fn summary(&mut self, step: u64, summary: Proto) -> std::io::Result<()> {
        self.event(
            Proto::default()
                .double(1, wall_time())
                .int(2, step)
                .message(5, summary),
        )
    }

    /// Frames `event` as a TFRecord (length, its masked CRC, data, its masked CRC).
    fn event(&mut self, event: Proto) -> std::io::Result<()> {
        let len = (event.0.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc(&len).to_le_bytes())?;
        self.file.write_all(&event.0)?;
        self.file.write_all(&masked_crc(&event.0).to_le_bytes())?;
        self.file.flush()
    }
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_tensorflows_masked_crc32c() {
        // tensorboard's `pywrap_tensorflow.masked_crc32c` of the same bytes.
        assert_eq!(masked_crc(b"123456789"), 0xC78A_B0E5);
        assert_eq!(masked_crc(b""), 0xA282_EAD8);
    }

    #[test]
    fn varints_and_keys_are_protobuf_encoded() {
        let p = Proto::default().int(2, 300).bytes(3, b"ab").float(2, 1.0);
        assert_eq!(
            p.0,
            [
                0x10, 0xAC, 0x02, 0x1A, 2, b'a', b'b', 0x15, 0, 0, 0x80, 0x3F
            ]
        );
    }
}
