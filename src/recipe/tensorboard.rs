//! TensorBoard's event files, written and read in this one file: [`EventWriter`] appends scalar
//! summaries as TensorBoard (and `torch.utils.tensorboard`'s `SummaryWriter`) writes them, and
//! [`read_events`] reads a file back by the same specification, checking every checksum. No
//! TensorFlow, protobuf or TensorBoard crate is needed: a scalar event is a few bytes of protobuf.
//!
//! The format (TensorFlow's `core/lib/io/record_writer.cc` and `core/util/event.proto`):
//! - a file is named `events.out.tfevents.<unix seconds>.<host>` (TensorBoard lists a directory's
//!   files whose name holds `tfevents`);
//! - it is a sequence of records: the data's length as a little-endian `u64`, the masked CRC32C
//!   of those 8 bytes (`u32` LE), the data, the masked CRC32C of the data (`u32` LE); a masked
//!   CRC is `((crc >> 15) | (crc << 17)) + 0xa282ead8`;
//! - each record's data is an `Event` message: `wall_time` (field 1, double), `step` (field 2,
//!   int64), `file_version` (field 3, string; the first event's, `brain.Event:2`) or `summary`
//!   (field 5), whose repeated `value` (field 1) each hold a `tag` (field 1, string) and a
//!   `simple_value` (field 2, float).
//!
//! Guarantees: each [`EventWriter::scalars`] is one event, flushed before it returns, so a
//! reader (or a crash) sees whole events only; [`read_events`] refuses a truncated record, a bad
//! checksum or a malformed message with an error naming the file and the byte offset, and skips
//! the fields it does not know, as protobuf readers do.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{RecipeError, Result};

/// The version string of the first event of every file.
pub const FILE_VERSION: &str = "brain.Event:2";

/// An open event file that scalars are appended to (see the [module docs](self)).
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// A new event file in `dir` (made if missing), its first event the file version.
    pub fn create(dir: &Path) -> Result<EventWriter> {
        let io = |context: String| move |source| RecipeError::Io { context, source };
        std::fs::create_dir_all(dir).map_err(io(format!("--tensorboard {}", dir.display())))?;
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default();
        let host = match host.is_empty() {
            true => "localhost".to_string(),
            false => host,
        };
        let name = format!(
            "events.out.tfevents.{}.{host}.{}",
            unix_time() as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let file = File::create(&path).map_err(io(format!("--tensorboard {}", path.display())))?;
        let mut writer = EventWriter {
            path,
            file: BufWriter::new(file),
        };
        let mut event = Vec::new();
        put_double(&mut event, 1, unix_time());
        put_bytes(&mut event, 3, FILE_VERSION.as_bytes());
        writer.append(&event)?;
        Ok(writer)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event at `step` holding each `(tag, value)` as a scalar (fp32, as TensorBoard keeps
    /// them).
    pub fn scalars(&mut self, step: u64, scalars: &[(&str, f64)]) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            put_key(&mut v, 2, 5);
            v.extend_from_slice(&(*value as f32).to_le_bytes());
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, unix_time());
        put_key(&mut event, 2, 0);
        put_varint(&mut event, step);
        put_bytes(&mut event, 5, &summary);
        self.append(&event)
    }

    /// Appends one record holding `data`, and flushes.
    fn append(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(data);
        record.extend_from_slice(&masked_crc(data).to_le_bytes());
        let context = format!("writing {}", self.path.display());
        self.file
            .write_all(&record)
            .and_then(|()| self.file.flush())
            .map_err(|source| RecipeError::Io { context, source })
    }
}

/// One event read back: its time, its step, and either the file version or scalars.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Event {
    pub wall_time: f64,
    pub step: i64,
    pub file_version: Option<String>,
    pub scalars: Vec<(String, f32)>,
}

/// Every event of the file at `path`, every checksum checked (see the [module docs](self)).
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let bytes = std::fs::read(path).map_err(|source| RecipeError::Io {
        context: format!("reading {}", path.display()),
        source,
    })?;
    let bad = |at: usize, what: &str| {
        RecipeError::Invalid(format!(
            "{}: {what} at byte {at}: not a TensorBoard event file",
            path.display()
        ))
    };
    let mut events = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + 12)
            .ok_or_else(|| bad(at, "a truncated record header"))?;
        let (len, crc) = header.split_at(8);
        if masked_crc(len) != u32::from_le_bytes(crc.try_into().unwrap_or_default()) {
            return Err(bad(at, "a length whose checksum does not match"));
        }
        let len = u64::from_le_bytes(len.try_into().unwrap_or_default());
        let start = at + 12;
        let end = usize::try_from(len)
            .ok()
            .and_then(|len| start.checked_add(len))
            .filter(|&end| end + 4 <= bytes.len())
            .ok_or_else(|| bad(at, "a record longer than the file"))?;
        let (data, crc) = (&bytes[start..end], &bytes[end..end + 4]);
        if masked_crc(data) != u32::from_le_bytes(crc.try_into().unwrap_or_default()) {
            return Err(bad(start, "data whose checksum does not match"));
        }
        events.push(decode_event(data).map_err(|what| bad(start, &what))?);
        at = end + 4;
    }
    Ok(events)
}

/// The event file(s) of `dir`, in name order.
pub fn event_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|source| RecipeError::Io {
        context: format!("reading {}", dir.display()),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().contains("tfevents"))
        })
        .collect();
    files.sort();
    Ok(files)
}

fn unix_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A field's key: its number and wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
fn put_key(out: &mut Vec<u8>, field: u64, wire: u64) {
    put_varint(out, (field << 3) | wire);
}

fn put_double(out: &mut Vec<u8>, field: u64, v: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A protobuf message's fields, read one at a time.
struct Fields<'a> {
    data: &'a [u8],
    at: usize,
}

/// One field's value.
enum Value<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Bytes(&'a [u8]),
    Fixed32([u8; 4]),
}

impl<'a> Fields<'a> {
    fn varint(&mut self) -> std::result::Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *self.data.get(self.at).ok_or("a truncated varint")?;
            self.at += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("a varint longer than 10 bytes".into())
    }

    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.ok_or("a field longer than its message")?;
        let out = &self.data[self.at..end];
        self.at = end;
        Ok(out)
    }

    /// The next field's number and value, `None` at the end.
    fn next(&mut self) -> std::result::Result<Option<(u64, Value<'a>)>, String> {
        if self.at == self.data.len() {
            return Ok(None);
        }
        let key = self.varint()?;
        let value = match key & 7 {
            0 => Value::Varint(self.varint()?),
            1 => Value::Fixed64(self.take(8)?.try_into().unwrap_or_default()),
            2 => {
                let n = usize::try_from(self.varint()?).map_err(|e| e.to_string())?;
                Value::Bytes(self.take(n)?)
            }
            5 => Value::Fixed32(self.take(4)?.try_into().unwrap_or_default()),
            wire => return Err(format!("wire type {wire}, which events do not use")),
        };
        Ok(Some((key >> 3, value)))
    }
}

fn decode_event(data: &[u8]) -> std::result::Result<Event, String> {
    let mut event = Event::default();
    let mut fields = Fields { data, at: 0 };
    while let Some((field, value)) = fields.next()? {
        match (field, value) {
            (1, Value::Fixed64(b)) => event.wall_time = f64::from_le_bytes(b),
            (2, Value::Varint(v)) => event.step = v as i64,
            (3, Value::Bytes(b)) => {
                let text = std::str::from_utf8(b).map_err(|_| "a file version not in UTF-8")?;
                event.file_version = Some(text.to_string());
            }
            (5, Value::Bytes(b)) => event.scalars.extend(decode_summary(b)?),
            _ => {}
        }
    }
    Ok(event)
}

fn decode_summary(data: &[u8]) -> std::result::Result<Vec<(String, f32)>, String> {
    let mut scalars = Vec::new();
    let mut fields = Fields { data, at: 0 };
    while let Some((field, value)) = fields.next()? {
        let (1, Value::Bytes(b)) = (field, value) else {
            continue;
        };
        let (mut tag, mut simple) = (None, None);
        let mut inner = Fields { data: b, at: 0 };
        while let Some((field, value)) = inner.next()? {
            match (field, value) {
                (1, Value::Bytes(t)) => {
                    tag = Some(String::from_utf8(t.to_vec()).map_err(|_| "a tag not in UTF-8")?)
                }
                (2, Value::Fixed32(v)) => simple = Some(f32::from_le_bytes(v)),
                _ => {}
            }
        }
        if let (Some(tag), Some(v)) = (tag, simple) {
            scalars.push((tag, v));
        }
    }
    Ok(scalars)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The event TensorFlow's writer (`tf.summary` 2.x) makes for scalar `loss` = 0.5 at step 3
    /// and wall time 0, byte for byte.
    const TENSORFLOW_EVENT: [u8; 26] = [
        0x09, 0, 0, 0, 0, 0, 0, 0, 0, // wall_time: 0.0
        0x10, 0x03, // step: 3
        0x2a, 0x0d, // summary, 13 bytes
        0x0a, 0x0b, // value, 11 bytes
        0x0a, 0x04, b'l', b'o', b's', b's', // tag
        0x15, 0x00, 0x00, 0x00, 0x3f, // simple_value: 0.5f
    ];

    #[test]
    fn scalars_round_trip_through_a_file_with_checked_records() {
        let dir = std::env::temp_dir().join(format!("odc-tb-{}", std::process::id()));
        let mut w = EventWriter::create(&dir).unwrap();
        w.scalars(10, &[("loss", 1.25), ("mfu", 0.125)]).unwrap();
        w.scalars(20, &[("loss", 0.5)]).unwrap();
        let path = w.path().to_path_buf();
        drop(w);
        assert_eq!(event_files(&dir).unwrap(), std::slice::from_ref(&path));
        let events = read_events(&path).unwrap();
        assert_eq!(events.len(), 3);
        // The version event is TensorFlow's 24 bytes, so the file starts as every one does.
        let head = std::fs::read(&path).unwrap()[..12].to_vec();
        assert_eq!(head, [24, 0, 0, 0, 0, 0, 0, 0, 0xa3, 0x7f, 0x4b, 0x22]);
        assert_eq!(events[0].file_version.as_deref(), Some(FILE_VERSION));
        assert_eq!(events[1].step, 10);
        assert_eq!(
            events[1].scalars,
            [("loss".to_string(), 1.25), ("mfu".to_string(), 0.125)]
        );
        assert_eq!(events[2].scalars, [("loss".to_string(), 0.5)]);
        assert!(events[2].wall_time > 1.6e9);
        // A flipped bit anywhere is refused, naming the file.
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(
            err.contains("checksum") && err.contains("tfevents"),
            "{err}"
        );
        bytes.truncate(n - 3);
        std::fs::write(&path, &bytes).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains("longer than the file"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_event_is_encoded_as_tensorflow_encodes_it() {
        let mut ours = Vec::new();
        let mut summary = Vec::new();
        let mut value = Vec::new();
        put_bytes(&mut value, 1, b"loss");
        put_key(&mut value, 2, 5);
        value.extend_from_slice(&0.5f32.to_le_bytes());
        put_bytes(&mut summary, 1, &value);
        put_double(&mut ours, 1, 0.0);
        put_key(&mut ours, 2, 0);
        put_varint(&mut ours, 3);
        put_bytes(&mut ours, 5, &summary);
        assert_eq!(ours, TENSORFLOW_EVENT);
        let event = decode_event(&ours).unwrap();
        assert_eq!((event.step, event.scalars), (3, vec![("loss".into(), 0.5)]));
        // Every TensorBoard file's first bytes: the 24-byte version event's length, and its
        // masked CRC32C `a3 7f 4b 22`.
        assert_eq!(
            masked_crc(&24u64.to_le_bytes()).to_le_bytes(),
            [0xa3, 0x7f, 0x4b, 0x22]
        );
    }
}
