//! The gangs of one process: [`GangRegistry`] hands each member its end of an in-process gang,
//! made when the first member asks.
//!
//! Invariants (tested in `super::tests`):
//! - the members of one gang (one attempt's epoch and gang number) get the ends of one
//!   [`InProcessGang`], each member exactly once;
//! - a gang of an older epoch than one already seen is refused (its attempt is over: a replay
//!   plans new gangs under a new epoch), and what an older attempt's members never took is
//!   dropped, so the registry holds at most the current attempt's gangs;
//! - [`GangRegistry::abort_before`] aborts every gang of an older attempt, its members' waits
//!   included: a member blocked on a peer of a discarded attempt (a peer that died before it
//!   sent) stops at once instead of at its deadline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::link::{GangLink, InProcessGang, InProcessLink};
use crate::model::error::{Error, Result};

/// The ends of one gang its members have not taken yet, in member order.
type Ends = Vec<Option<Arc<InProcessLink>>>;

/// See the [module docs](self).
#[derive(Debug, Default)]
pub struct GangRegistry {
    /// `(epoch, gang)` → its ends.
    gangs: Mutex<HashMap<(u64, u32), Ends>>,
    /// Every gang made, by epoch, through one of its ends (weak: a gang whose ends are all gone
    /// has nobody left to wake).
    made: Mutex<Vec<(u64, Weak<InProcessLink>)>>,
}

impl GangRegistry {
    /// Member `member`'s end of gang `gang` of attempt `epoch`, a gang of `members` whose waits
    /// last at most `timeout`.
    pub fn link(
        &self,
        epoch: u64,
        gang: u32,
        member: u32,
        members: u32,
        timeout: Duration,
    ) -> Result<Arc<InProcessLink>> {
        let bad = |reason: String| Err(Error::Gang(reason));
        if member >= members {
            return bad(format!(
                "member {member} of gang {gang} of a gang of {members}"
            ));
        }
        let mut gangs = self
            .gangs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(newer) = gangs.keys().map(|&(e, _)| e).filter(|&e| e > epoch).max() {
            return bad(format!(
                "gang {gang} of epoch {epoch} is over: epoch {newer} has started"
            ));
        }
        gangs.retain(|&(e, _), _| e >= epoch);
        let ends = gangs.entry((epoch, gang)).or_insert_with(|| {
            let links = InProcessGang::links(members as usize, timeout);
            if let Some(first) = links.first() {
                let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
                made.retain(|(_, gang)| gang.strong_count() > 0);
                made.push((epoch, Arc::downgrade(first)));
            }
            links.into_iter().map(Some).collect()
        });
        if ends.len() != members as usize {
            return bad(format!(
                "gang {gang} of epoch {epoch} has {} members, member {member} says {members}",
                ends.len()
            ));
        }
        let Some(link) = ends[member as usize].take() else {
            return bad(format!(
                "member {member} of gang {gang} of epoch {epoch} asked twice"
            ));
        };
        if ends.iter().all(Option::is_none) {
            gangs.remove(&(epoch, gang));
        }
        Ok(link)
    }

    /// Aborts every gang of an attempt older than `epoch` (see the module docs).
    pub fn abort_before(&self, epoch: u64) {
        let old: Vec<Arc<InProcessLink>> = {
            let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
            let (older, newer): (Vec<_>, Vec<_>) = made.drain(..).partition(|(e, _)| *e < epoch);
            *made = newer;
            older
                .into_iter()
                .filter_map(|(_, gang)| gang.upgrade())
                .collect()
        };
        for gang in old {
            gang.abort(&format!(
                "attempt {epoch} started: this gang's attempt was discarded"
            ));
        }
    }

    /// Gangs some of whose members have not asked yet.
    pub fn open(&self) -> usize {
        self.gangs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len()
    }
}
