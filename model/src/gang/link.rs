//! How the members of a gang pass tensors to each other: [`GangLink`], and the in-process
//! mailbox [`InProcessGang`].
//!
//! Invariants (tested in `super::tests`):
//! - **Every wait has a deadline (I6).** A [`GangLink::recv`] returns the message or, by the
//!   link's deadline, an error naming this member, the sender and the tag; it never blocks
//!   forever.
//! - **A failure ends the gang at once.** [`GangLink::abort`] (a member's compute failed) makes
//!   every pending and later `recv` of every member fail with the reason, so that the gang's
//!   micro-batch is replayed as a whole (I2) without waiting out the deadline.
//! - **A message is delivered once.** Sending the same tag twice to a member is an error (a
//!   replay must use a fresh link), and `recv` takes the message out of the mailbox.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use crate::error::{Error, Result};

/// Which pass a ring step belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    Forward,
    Backward,
}

/// What a message is: a ring step of one attention call, in one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag {
    /// The gang's attention call: each member counts its attention calls in the same order
    /// (one per layer's forward, recomputed forwards included).
    pub call: u32,
    pub pass: Pass,
    pub step: u32,
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pass = match self.pass {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        };
        write!(f, "attention call {} {pass} step {}", self.call, self.step)
    }
}

/// One member's end of a gang's links.
pub trait GangLink: Send + Sync + fmt::Debug {
    /// This member's index in the gang.
    fn member(&self) -> usize;
    /// Members of the gang.
    fn members(&self) -> usize;
    /// Sends `tensors` to member `to` under `tag`, without waiting for the receiver.
    fn send(&self, to: usize, tag: Tag, tensors: Vec<Tensor>) -> Result<()>;
    /// What member `from` sent under `tag`, waiting at most until the link's deadline.
    fn recv(&self, from: usize, tag: Tag) -> Result<Vec<Tensor>>;
    /// Ends the gang: every member's waits fail with `reason` from now on.
    fn abort(&self, reason: &str);
}

/// Mailboxes of one in-process gang: member `i`'s holds what was sent to it, keyed by sender and
/// tag.
#[derive(Debug)]
struct Mailboxes {
    boxes: Mutex<State>,
    arrived: Condvar,
    timeout: Duration,
}

#[derive(Debug, Default)]
struct State {
    /// `(to, from, tag)` → tensors.
    messages: HashMap<(usize, usize, Tag), Vec<Tensor>>,
    aborted: Option<String>,
}

/// A gang whose members run in one process (threads of one trainer process, or tests): each
/// member's [`GangLink`] is an [`InProcessLink`].
#[derive(Debug)]
pub struct InProcessGang;

impl InProcessGang {
    /// The links of a gang of `members`, member `i` at index `i`; every `recv` waits at most
    /// `timeout`.
    pub fn links(members: usize, timeout: Duration) -> Vec<Arc<InProcessLink>> {
        let shared = Arc::new(Mailboxes {
            boxes: Mutex::new(State::default()),
            arrived: Condvar::new(),
            timeout,
        });
        (0..members)
            .map(|member| {
                Arc::new(InProcessLink {
                    member,
                    members,
                    shared: shared.clone(),
                })
            })
            .collect()
    }
}

/// One member's end of an [`InProcessGang`].
#[derive(Debug)]
pub struct InProcessLink {
    member: usize,
    members: usize,
    shared: Arc<Mailboxes>,
}

impl InProcessLink {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A member that panicked while holding the lock left a consistent map (inserts and
        // removes are single operations): go on with it.
        self.shared
            .boxes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn check_member(&self, other: usize, role: &str) -> Result<()> {
        if other >= self.members {
            return Err(Error::Gang(format!(
                "member {} of a gang of {}: no member {other} to {role}",
                self.member, self.members
            )));
        }
        Ok(())
    }
}

impl GangLink for InProcessLink {
    fn member(&self) -> usize {
        self.member
    }

    fn members(&self) -> usize {
        self.members
    }

    fn send(&self, to: usize, tag: Tag, tensors: Vec<Tensor>) -> Result<()> {
        self.check_member(to, "send to")?;
        let mut state = self.lock();
        if let Some(reason) = &state.aborted {
            return Err(Error::Gang(format!("the gang was aborted: {reason}")));
        }
        let key = (to, self.member, tag);
        if state.messages.contains_key(&key) {
            return Err(Error::Gang(format!(
                "member {} sent {tag} to member {to} twice",
                self.member
            )));
        }
        state.messages.insert(key, tensors);
        drop(state);
        self.shared.arrived.notify_all();
        Ok(())
    }

    fn recv(&self, from: usize, tag: Tag) -> Result<Vec<Tensor>> {
        self.check_member(from, "receive from")?;
        let deadline = Instant::now() + self.shared.timeout;
        let mut state = self.lock();
        loop {
            if let Some(reason) = &state.aborted {
                return Err(Error::Gang(format!("the gang was aborted: {reason}")));
            }
            if let Some(tensors) = state.messages.remove(&(self.member, from, tag)) {
                return Ok(tensors);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Gang(format!(
                    "member {} waited {:?} for member {from}'s {tag}: missed its deadline",
                    self.member, self.shared.timeout
                )));
            }
            state = self
                .shared
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    fn abort(&self, reason: &str) {
        let mut state = self.lock();
        if state.aborted.is_none() {
            state.aborted = Some(format!("member {}: {reason}", self.member));
        }
        drop(state);
        self.shared.arrived.notify_all();
    }
}
