//! Owner side of a segment ([`SegmentWriter`]): creates the file, publishes into it under the
//! seqlock, unlinks it when dropped.

use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;
use parking_lot::Mutex;

use super::error::{io_error, SegmentError};
use super::layout::{
    put, Geometry, CONTROL_VERSION, LAYOUT_VERSION, MAGIC, MAX_JOB_LEN, OFF_CHUNKS,
    OFF_CHUNK_BYTES, OFF_DATA, OFF_ELEMENTS, OFF_ELEM_SIZE, OFF_ENDPOINT, OFF_HANDLE_ID,
    OFF_INSTANCE, OFF_JOB, OFF_JOB_LEN, OFF_LAYOUT, OFF_MAGIC, OFF_PID, OFF_REGION, OFF_START_TIME,
    OFF_STATE, OFF_TOTAL, TEMP_SEPARATOR,
};
use super::name::{job_is_valid, parse_segment_name, segment_name};
use super::owner::{owner_gone, recorded_start_time, Owner};
use super::reader::MappedControls;
use crate::seqlock;

/// Removes the file at `path` when dropped.
pub(super) struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = fs::remove_file(self.0);
    }
}

/// Owner side of a segment: creates the file, publishes into it, and unlinks it when dropped
/// (readers that mapped it keep reading the last publication).
#[derive(Debug)]
pub(crate) struct SegmentWriter {
    pub(super) name: String,
    pub(super) path: PathBuf,
    /// (device, inode) of the file, so `Drop` never unlinks a file that replaced it.
    pub(super) identity: (u64, u64),
    pub(super) geometry: Geometry,
    /// The read-write mapping; the mutex makes publications single-writer.
    pub(super) map: Mutex<MmapMut>,
    pub(super) version: AtomicU64,
}

pub(super) static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl SegmentWriter {
    /// Creates segment `segment_name(job, <this pid>, region)` in `dir` holding `initial`
    /// (`elements · elem_size` bytes) at `version`. A segment of that name whose owner is gone is
    /// replaced; one whose owner is alive is [`SegmentError::Exists`].
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create(
        dir: &Path,
        job: &str,
        region: u64,
        elem_size: usize,
        elements: usize,
        chunk_bytes: usize,
        initial: &[u8],
        version: u64,
    ) -> Result<Self, SegmentError> {
        Self::create_for(
            dir,
            job,
            0,
            0,
            0,
            region,
            elem_size,
            elements,
            chunk_bytes,
            initial,
            version,
        )
    }

    /// [`SegmentWriter::create`] for the data-plane endpoint `endpoint`, transport instance
    /// `instance` and handle region id `handle_id`, recorded in the header so readers refuse a
    /// handle naming another owner, instance or region.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create_for(
        dir: &Path,
        job: &str,
        endpoint: u32,
        instance: u64,
        handle_id: u64,
        region: u64,
        elem_size: usize,
        elements: usize,
        chunk_bytes: usize,
        initial: &[u8],
        version: u64,
    ) -> Result<Self, SegmentError> {
        let shape = Shape {
            elem_size,
            elements,
            chunk_bytes,
            endpoint,
            instance,
            handle_id,
        };
        Self::create_as(dir, job, region, shape, initial, version, Owner::current())
    }

    pub(super) fn create_as(
        dir: &Path,
        job: &str,
        region: u64,
        shape: Shape,
        initial: &[u8],
        version: u64,
        owner: Owner,
    ) -> Result<Self, SegmentError> {
        if !job_is_valid(job) {
            return Err(SegmentError::Invalid {
                what: format!("job id {job:?} is not [A-Za-z0-9_.-]{{1,{MAX_JOB_LEN}}}"),
            });
        }
        let wide = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        let geometry = Geometry::new(
            wide(shape.elem_size),
            wide(shape.elements),
            wide(shape.chunk_bytes),
        )
        .map_err(|what| SegmentError::Invalid { what })?;
        let name = segment_name(job, owner.pid, region);
        if initial.len() != geometry.data_bytes {
            return Err(SegmentError::LengthMismatch {
                name,
                expected: geometry.data_bytes,
                found: initial.len(),
            });
        }
        let path = dir.join(&name);
        // A fresh temporary name; one can be taken by a leftover of an earlier process that had
        // this pid, so move on to the next counter then.
        let (temp, file) = {
            let mut attempts = 0;
            loop {
                let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
                let temp = dir.join(format!(".{name}{TEMP_SEPARATOR}{n}"));
                match OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&temp)
                {
                    Ok(file) => break (temp, file),
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempts < 16 => {
                        attempts += 1;
                    }
                    Err(e) => return Err(io_error(&temp, &e)),
                }
            }
        };
        let remove_temp = RemoveOnDrop(&temp);
        file.set_len(wide(geometry.total))
            .map_err(|e| io_error(&temp, &e))?;
        // SAFETY: the file was just created by us under a fresh name and sized; nothing else
        // writes it (it is mode 0600 and only the owner ever maps it writable), and it is never
        // truncated while mapped.
        let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| io_error(&temp, &e))?;
        if map.len() != geometry.total {
            return Err(SegmentError::Io {
                path: temp.display().to_string(),
                error: format!("mapped {} bytes, expected {}", map.len(), geometry.total),
            });
        }

        put(&mut map, OFF_MAGIC, &MAGIC);
        put(&mut map, OFF_LAYOUT, &LAYOUT_VERSION.to_ne_bytes());
        // `Geometry::new` checked that the element size fits in u32.
        let elem_size = u32::try_from(geometry.elem_size).unwrap_or(u32::MAX);
        put(&mut map, OFF_ELEM_SIZE, &elem_size.to_ne_bytes());
        put(&mut map, OFF_PID, &owner.pid.to_ne_bytes());
        let job_len = u32::try_from(job.len()).unwrap_or(u32::MAX);
        put(&mut map, OFF_JOB_LEN, &job_len.to_ne_bytes());
        put(&mut map, OFF_START_TIME, &owner.start_time.to_ne_bytes());
        put(&mut map, OFF_REGION, &region.to_ne_bytes());
        put(
            &mut map,
            OFF_ELEMENTS,
            &wide(geometry.elements).to_ne_bytes(),
        );
        put(
            &mut map,
            OFF_CHUNK_BYTES,
            &wide(geometry.chunk_bytes).to_ne_bytes(),
        );
        put(&mut map, OFF_CHUNKS, &wide(geometry.chunks).to_ne_bytes());
        put(
            &mut map,
            OFF_DATA,
            &wide(geometry.data_offset).to_ne_bytes(),
        );
        put(&mut map, OFF_TOTAL, &wide(geometry.total).to_ne_bytes());
        put(&mut map, OFF_JOB, job.as_bytes());
        put(&mut map, OFF_ENDPOINT, &shape.endpoint.to_ne_bytes());
        put(&mut map, OFF_INSTANCE, &shape.instance.to_ne_bytes());
        put(&mut map, OFF_HANDLE_ID, &shape.handle_id.to_ne_bytes());
        for c in 0..geometry.chunks {
            // seq stays 0 (the file is zero-filled): even, stable.
            put(
                &mut map,
                geometry.control(c) + CONTROL_VERSION,
                &version.to_ne_bytes(),
            );
        }
        put(&mut map, geometry.data_offset, initial);

        Self::link_exclusive(&temp, &path, &name)?;
        drop(remove_temp);
        // The identity of the inode we filled, which now carries the final name.
        let meta = file.metadata().map_err(|e| io_error(&path, &e))?;
        Ok(Self {
            name,
            path,
            identity: (meta.dev(), meta.ino()),
            geometry,
            map: Mutex::new(map),
            version: AtomicU64::new(version),
        })
    }

    /// Gives the filled temporary file its final name, failing if the name exists with a live
    /// owner; a stale file of that name is removed first.
    pub(super) fn link_exclusive(temp: &Path, path: &Path, name: &str) -> Result<(), SegmentError> {
        let mut last_pid = 0;
        for _ in 0..3 {
            match fs::hard_link(temp, path) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    let pid = parse_segment_name(name).map_or(0, |parsed| parsed.pid);
                    last_pid = pid;
                    let recorded = recorded_start_time(path, pid);
                    if !owner_gone(pid, recorded.map(|(start, _)| start)) {
                        return Err(SegmentError::Exists {
                            name: name.to_string(),
                            pid,
                        });
                    }
                    match fs::remove_file(path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(io_error(path, &e)),
                    }
                }
                Err(e) => return Err(io_error(path, &e)),
            }
        }
        Err(SegmentError::Exists {
            name: name.to_string(),
            pid: last_pid,
        })
    }

    /// The segment's file name (what a reader passes to [`SegmentReader::open`]).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Replaces all data with `data` and sets every chunk's version to `version`. Data of the
    /// wrong length is [`SegmentError::LengthMismatch`] and changes nothing.
    pub(crate) fn publish(&self, version: u64, data: &[u8]) -> Result<(), SegmentError> {
        let geometry = self.geometry;
        if data.len() != geometry.data_bytes {
            return Err(SegmentError::LengthMismatch {
                name: self.name.clone(),
                expected: geometry.data_bytes,
                found: data.len(),
            });
        }
        let mut map = self.map.lock();
        let base = map.as_mut_ptr();
        let controls = MappedControls { base, geometry };
        seqlock::publish(&controls, geometry.chunks, version, |c| {
            let range = geometry.chunk_range(c);
            // SAFETY: `range` is inside `0..data_bytes`, so the source lies in `data` (its
            // length was checked) and the destination in the mapping's data area; the two
            // don't overlap (`data` is caller memory, not this mapping, which we hold
            // exclusively through the lock).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr().add(range.start),
                    base.add(geometry.data_offset + range.start),
                    range.len(),
                );
            }
        });
        self.version.store(version, Ordering::Release);
        Ok(())
    }

    /// Sets every chunk's version to `version`, the data as it is (a frozen region's next
    /// publication: no copy), inside each chunk's seqlock as [`SegmentWriter::publish`] does.
    pub(crate) fn republish(&self, version: u64) {
        let geometry = self.geometry;
        let mut map = self.map.lock();
        let controls = MappedControls {
            base: map.as_mut_ptr(),
            geometry,
        };
        seqlock::publish(&controls, geometry.chunks, version, |_| {});
        self.version.store(version, Ordering::Release);
    }

    /// For a segment whose data lives elsewhere (the `cuda` backend keeps it in device memory and
    /// its segments have no data): run `write`, which replaces that data and returns once it is in
    /// place, inside chunk 0's seqlock, as [`SegmentWriter::publish`] does with its copy, and record
    /// `version`. If `write` fails, `seq` stays odd (the data may be torn: readers wait, and miss
    /// their deadline, rather than see it) until a later publication succeeds.
    #[cfg(feature = "cuda-code")]
    pub(crate) fn publish_outside<E>(
        &self,
        version: u64,
        write: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        let mut map = self.map.lock();
        let controls = MappedControls {
            base: map.as_mut_ptr(),
            geometry: self.geometry,
        };
        seqlock::publish_outside(&controls, version, write)?;
        self.version.store(version, Ordering::Release);
        Ok(())
    }

    /// The version of the last publication (or the initial one).
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Test hook: sets chunk `chunk`'s seq word, e.g. odd, as a writer that died mid-publish
    /// leaves it.
    #[cfg(test)]
    pub(super) fn poke_seq(&self, chunk: usize, value: u64) {
        assert!(chunk < self.geometry.chunks);
        let mut map = self.map.lock();
        let control = self.geometry.control(chunk);
        // SAFETY: as in `publish`: in bounds, aligned, accessed atomically only.
        let seq = unsafe { AtomicU64::from_ptr(map.as_mut_ptr().add(control).cast::<u64>()) };
        seq.store(value, Ordering::Release);
    }
}

impl Drop for SegmentWriter {
    fn drop(&mut self) {
        // Tell readers that mapped the segment earlier that the region is gone.
        {
            let mut map = self.map.lock();
            // SAFETY: OFF_STATE is 8-aligned (the mapping is page aligned) and inside the header
            // page; the word is only ever accessed atomically.
            let state =
                unsafe { AtomicU64::from_ptr(map.as_mut_ptr().add(OFF_STATE).cast::<u64>()) };
            state.store(1, Ordering::Release);
        }
        // Unlink only the file we created (a sweeper could in principle have replaced it).
        if let Ok(meta) = fs::symlink_metadata(&self.path) {
            if (meta.dev(), meta.ino()) == self.identity {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

/// A segment's shape as given to [`SegmentWriter::create`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) elem_size: usize,
    pub(super) elements: usize,
    pub(super) chunk_bytes: usize,
    /// The owner's data-plane endpoint and transport instance, recorded in the header.
    pub(super) endpoint: u32,
    pub(super) instance: u64,
    pub(super) handle_id: u64,
}
