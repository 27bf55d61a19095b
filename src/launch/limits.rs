//! Process limits a job needs raised: open file descriptors. Each rank holds a connection per
//! peer and plane, each listener up to 64 unauthenticated ones (`odc_transport::wire::gate`), and
//! the usual soft limit (often 1,024) is far below the hard one (often 1,048,576).

use std::io;

/// Raise this process's soft limit on open file descriptors (`RLIMIT_NOFILE`) to its hard limit
/// (never lowers it) and return the soft limit now in force. Call it once at start, before
/// connections are made. An error names the call that failed and the limits; nothing panics.
///
/// ```
/// let limit = odc::launch::raise_fd_limit().expect("the descriptor limit");
/// assert!(limit >= 64);
/// ```
pub fn raise_fd_limit() -> io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes one `rlimit` through the pointer, which points at a live,
    // writable local of that type, and keeps no reference to it.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("getrlimit(RLIMIT_NOFILE) failed: {e}"),
        ));
    }
    if limit.rlim_cur >= limit.rlim_max {
        return Ok(widen(limit.rlim_cur));
    }
    let raised = libc::rlimit {
        rlim_cur: limit.rlim_max,
        rlim_max: limit.rlim_max,
    };
    // SAFETY: `setrlimit` reads one `rlimit` through the pointer, which points at a live local of
    // that type, and keeps no reference to it.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!(
                "setrlimit(RLIMIT_NOFILE) from a soft limit of {} to the hard limit {} failed: {e}",
                limit.rlim_cur, limit.rlim_max
            ),
        ));
    }
    Ok(widen(raised.rlim_cur))
}

/// `rlim_t` is 64 bits on the targets odc runs on, 32 on a few others.
#[allow(clippy::useless_conversion)]
fn widen(limit: libc::rlim_t) -> u64 {
    u64::from(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_descriptor_limit_is_raised_to_the_hard_one() {
        let raised = raise_fd_limit().expect("raise");
        let mut now = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as in `raise_fd_limit`: one `rlimit` written through a pointer to a live local.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) }, 0);
        assert_eq!(raised, widen(now.rlim_cur));
        assert_eq!(now.rlim_cur, now.rlim_max, "soft = hard");
        assert_eq!(raise_fd_limit().expect("again"), raised, "idempotent");
    }
}
