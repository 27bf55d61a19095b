//! A segment's file name (`odc-{job}-{owner_pid}-{region}`, and the temporary `.{name}~{n}`),
//! made and parsed back.

use super::layout::{MAX_JOB_LEN, NAME_PREFIX, TEMP_SEPARATOR};

/// The parts of a segment file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SegmentName {
    pub(crate) job: String,
    pub(crate) pid: u32,
    pub(crate) region: u64,
}

/// `odc-{job}-{pid}-{region}`.
pub(crate) fn segment_name(job: &str, pid: u32, region: u64) -> String {
    format!("{NAME_PREFIX}{job}-{pid}-{region}")
}

/// Parses a name made by [`segment_name`]; `None` for anything else (including a job id outside
/// `[A-Za-z0-9_.-]{1,64}`, a pid of 0 or above `i32::MAX`, and non-canonical numbers).
pub(crate) fn parse_segment_name(name: &str) -> Option<SegmentName> {
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let (rest, region) = rest.rsplit_once('-')?;
    let (job, pid) = rest.rsplit_once('-')?;
    if !job_is_valid(job) {
        return None;
    }
    let pid: u32 = pid.parse().ok()?;
    let region: u64 = region.parse().ok()?;
    if pid == 0 || libc::pid_t::try_from(pid).is_err() || segment_name(job, pid, region) != name {
        return None;
    }
    Some(SegmentName {
        job: job.to_string(),
        pid,
        region,
    })
}

/// Parses a final name or a temporary one (`.{name}~{n}`); the flag says which.
pub(super) fn parse_any_name(name: &str) -> Option<(SegmentName, bool)> {
    if let Some(rest) = name.strip_prefix('.') {
        let (base, n) = rest.rsplit_once(TEMP_SEPARATOR)?;
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        return parse_segment_name(base).map(|parsed| (parsed, true));
    }
    parse_segment_name(name).map(|parsed| (parsed, false))
}

pub(crate) fn job_is_valid(job: &str) -> bool {
    (1..=MAX_JOB_LEN).contains(&job.len())
        && job
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}
