//! The file format's numbers: the header's fields and offsets, the chunks' control pairs, the
//! checked geometry a shape derives, and the native words read and written in the header.

use std::ops::Range;

/// First 8 bytes of every segment.
pub(crate) const MAGIC: [u8; 8] = *b"ODCSHM01";
/// Layout version in the header; a reader refuses any other.
pub(crate) const LAYOUT_VERSION: u32 = 1;
/// Size of the header page; the control words start right after it.
pub(crate) const HEADER_BYTES: usize = 4096;
/// Stride of the per-chunk control pairs (one cache line each, so chunks don't false-share).
pub(crate) const CONTROL_STRIDE: usize = 64;
/// Longest job id.
pub(crate) const MAX_JOB_LEN: usize = 64;

pub(super) const NAME_PREFIX: &str = "odc-";
/// Separates a temporary name from its counter (`.{name}~{n}`); not in the job id alphabet.
pub(super) const TEMP_SEPARATOR: char = '~';

// Header field offsets.
pub(super) const OFF_MAGIC: usize = 0;
pub(super) const OFF_LAYOUT: usize = 8;
pub(super) const OFF_ELEM_SIZE: usize = 12;
pub(super) const OFF_PID: usize = 16;
pub(super) const OFF_JOB_LEN: usize = 20;
pub(super) const OFF_START_TIME: usize = 24;
pub(super) const OFF_REGION: usize = 32;
pub(super) const OFF_ELEMENTS: usize = 40;
pub(super) const OFF_CHUNK_BYTES: usize = 48;
pub(super) const OFF_CHUNKS: usize = 56;
pub(super) const OFF_DATA: usize = 64;
pub(super) const OFF_TOTAL: usize = 72;
pub(super) const OFF_JOB: usize = 80;
/// The owner's data-plane endpoint (u32), after the job id.
pub(super) const OFF_ENDPOINT: usize = OFF_JOB + MAX_JOB_LEN;
/// The owner's transport instance (u64), so a handle of another instance never reads this one.
pub(super) const OFF_INSTANCE: usize = OFF_ENDPOINT + 8;
/// The region id the owner's handles carry (u64), so a handle naming another region never reads
/// this one through its segment name.
pub(super) const OFF_HANDLE_ID: usize = OFF_INSTANCE + 8;
/// Bytes of the header page that carry fields.
pub(super) const HEADER_USED: usize = OFF_HANDLE_ID + 8;
/// The one header word that changes: 0 while the segment is live, 1 once its owner dropped it
/// (set before the file is unlinked, so a reader that mapped it earlier learns the region is
/// gone). On the header page's last cache line.
pub(super) const OFF_STATE: usize = HEADER_BYTES - CONTROL_STRIDE;

/// Offset of the version word within a control pair.
pub(super) const CONTROL_VERSION: usize = 8;

/// Sizes and offsets derived from the shape, all checked to fit (in `usize`, and below
/// `isize::MAX` so every slice and every `chunk · (index + 1)` is representable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    pub(super) elem_size: usize,
    pub(super) elements: usize,
    pub(super) chunk_bytes: usize,
    pub(super) chunks: usize,
    pub(super) data_bytes: usize,
    pub(super) data_offset: usize,
    pub(super) total: usize,
}

impl Geometry {
    /// Checks a shape; the error says what is wrong.
    pub(super) fn new(elem_size: u64, elements: u64, chunk_bytes: u64) -> Result<Self, String> {
        const LIMIT: u64 = isize::MAX as u64;
        if elem_size == 0 || elem_size > u64::from(u32::MAX) {
            return Err(format!("element size {elem_size} is not in 1..=2^32-1"));
        }
        if chunk_bytes == 0 || chunk_bytes % 8 != 0 || chunk_bytes % elem_size != 0 {
            return Err(format!(
                "chunk size {chunk_bytes} is not a positive multiple of 8 and of the element size {elem_size}"
            ));
        }
        if chunk_bytes > LIMIT {
            return Err(format!("chunk size {chunk_bytes} is too large"));
        }
        let too_large = || format!("{elements} elements of {elem_size} bytes are too large");
        let data_bytes = elements.checked_mul(elem_size).ok_or_else(too_large)?;
        let chunks = data_bytes.div_ceil(chunk_bytes).max(1);
        let total = chunks
            .checked_mul(CONTROL_STRIDE as u64)
            .and_then(|control| control.checked_add(HEADER_BYTES as u64))
            .and_then(|data_offset| data_offset.checked_add(data_bytes))
            .filter(|&total| total <= LIMIT)
            .ok_or_else(too_large)?;
        let size = |v: u64| usize::try_from(v).map_err(|_| too_large());
        let chunks = size(chunks)?;
        Ok(Self {
            elem_size: size(elem_size)?,
            elements: size(elements)?,
            chunk_bytes: size(chunk_bytes)?,
            chunks,
            data_bytes: size(data_bytes)?,
            data_offset: HEADER_BYTES + chunks * CONTROL_STRIDE,
            total: size(total)?,
        })
    }

    /// Offset of chunk `c`'s control pair.
    pub(super) fn control(&self, c: usize) -> usize {
        HEADER_BYTES + c * CONTROL_STRIDE
    }

    /// Data byte range of chunk `c` (`c < chunks`; empty for the one chunk of an empty segment).
    pub(super) fn chunk_range(&self, c: usize) -> Range<usize> {
        let start = (c * self.chunk_bytes).min(self.data_bytes);
        start..(start + self.chunk_bytes).min(self.data_bytes)
    }
}

pub(super) fn get_u32(bytes: &[u8], off: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[off..off + 4]);
    u32::from_ne_bytes(word)
}

pub(super) fn get_u64(bytes: &[u8], off: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[off..off + 8]);
    u64::from_ne_bytes(word)
}

pub(super) fn put(bytes: &mut [u8], off: usize, value: &[u8]) {
    bytes[off..off + value.len()].copy_from_slice(value);
}
