//! Deadlines (C6, docs/design.md I6: every wait is bounded): the clock they are compared with and
//! the refusal of an operation that starts too late.

use std::time::{Duration, Instant};

use crate::error::{Op, TransportError};
use crate::handle::{EndpointId, RegionId};

/// When an operation must be done by (docs/design.md I6: every wait is bounded). An operation that starts
/// at or after its deadline is refused with [`TransportError::DeadlineExceeded`] and changes
/// nothing; a wait that outlives it returns that error.
pub type Deadline = Instant;

/// The clock deadlines are compared with: tokio's (which is `std`'s unless a test pauses tokio's
/// clock, so virtual-time simulations and their deadlines agree).
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// The deadline `timeout` from [`now`] (saturating far in the future).
///
/// ```
/// let deadline = odc_transport::deadline_in(std::time::Duration::from_secs(5));
/// assert!(deadline > odc_transport::now());
/// ```
pub fn deadline_in(timeout: Duration) -> Deadline {
    let now = now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

/// Refuse an operation that starts at or after its deadline (C6).
pub fn check_deadline(
    deadline: Deadline,
    owner: EndpointId,
    region: RegionId,
    op: Op,
) -> Result<(), TransportError> {
    if now() >= deadline {
        Err(TransportError::DeadlineExceeded { owner, region, op })
    } else {
        Ok(())
    }
}
