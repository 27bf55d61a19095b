//! The minibatch ledger: which micro-batch is pending, with which trainer, or done.
//!
//! Invariants:
//! - **I2 exactly once**: a micro-batch is counted once. A completion from a trainer the micro-batch
//!   is not assigned to, or a second completion, is refused ([`LedgerError`]). A ledger belongs to
//!   one attempt: after a failure the minibatch is replayed with a fresh one.
//! - Only reports the step machine admitted reach the ledger (the assignment's token, the trainer
//!   running it, not a duplicate: [`crate::step`]), so a refusal here means the machine's
//!   own state is inconsistent, never that a peer lied.
//! - The barrier may run only when [`Ledger::is_complete`]: every micro-batch reported done by its
//!   trainer, which reports only after every owner acknowledged its gradient pushes (docs/design.md "One minibatch", step 4).

/// Refusals of the ledger, naming the micro-batch and trainer involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum LedgerError {
    #[error("micro-batch {micro_batch} does not exist (the minibatch has {len})")]
    Unknown { micro_batch: u32, len: u32 },
    #[error("micro-batch {micro_batch} is {state}, it cannot be assigned to trainer {trainer}")]
    NotPending {
        micro_batch: u32,
        trainer: u32,
        state: String,
    },
    #[error("trainer {trainer} reported micro-batch {micro_batch}, which is not assigned to it ({state})")]
    NotAssigned {
        micro_batch: u32,
        trainer: u32,
        state: String,
    },
    #[error("micro-batch {micro_batch} was already completed by trainer {by}")]
    Duplicate { micro_batch: u32, by: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Pending,
    Assigned(usize),
    Done(usize),
}

/// Ledger of one minibatch attempt.
#[derive(Debug, Clone)]
pub struct Ledger {
    entries: Vec<Entry>,
    done: usize,
}

impl Ledger {
    /// A ledger of `micro_batches` pending micro-batches.
    pub fn new(micro_batches: usize) -> Self {
        Ledger {
            entries: vec![Entry::Pending; micro_batches],
            done: 0,
        }
    }

    fn entry(&self, micro_batch: usize) -> Result<Entry, LedgerError> {
        self.entries
            .get(micro_batch)
            .copied()
            .ok_or(LedgerError::Unknown {
                micro_batch: micro_batch as u32,
                len: self.entries.len() as u32,
            })
    }

    /// Record that `trainer` took `micro_batch`.
    pub fn assign(&mut self, micro_batch: usize, trainer: usize) -> Result<(), LedgerError> {
        match self.entry(micro_batch)? {
            Entry::Pending => {
                self.entries[micro_batch] = Entry::Assigned(trainer);
                Ok(())
            }
            Entry::Assigned(_) => Err(LedgerError::NotPending {
                micro_batch: micro_batch as u32,
                trainer: trainer as u32,
                state: "assigned".into(),
            }),
            Entry::Done(_) => Err(LedgerError::NotPending {
                micro_batch: micro_batch as u32,
                trainer: trainer as u32,
                state: "done".into(),
            }),
        }
    }

    /// Record that `trainer` finished `micro_batch` and its pushes were acknowledged.
    pub fn complete(&mut self, micro_batch: usize, trainer: usize) -> Result<(), LedgerError> {
        match self.entry(micro_batch)? {
            Entry::Assigned(t) if t == trainer => {
                self.entries[micro_batch] = Entry::Done(trainer);
                self.done += 1;
                Ok(())
            }
            Entry::Done(by) => Err(LedgerError::Duplicate {
                micro_batch: micro_batch as u32,
                by: by as u32,
            }),
            Entry::Assigned(t) => Err(LedgerError::NotAssigned {
                micro_batch: micro_batch as u32,
                trainer: trainer as u32,
                state: format!("assigned to trainer {t}"),
            }),
            Entry::Pending => Err(LedgerError::NotAssigned {
                micro_batch: micro_batch as u32,
                trainer: trainer as u32,
                state: "pending".into(),
            }),
        }
    }

    /// The trainer that completed `micro_batch`, if it is done.
    pub fn done_by(&self, micro_batch: usize) -> Option<usize> {
        match self.entries.get(micro_batch) {
            Some(Entry::Done(trainer)) => Some(*trainer),
            _ => None,
        }
    }

    /// The trainer that holds `micro_batch`: running it or done with it.
    pub fn trainer_of(&self, micro_batch: usize) -> Option<usize> {
        match self.entries.get(micro_batch) {
            Some(Entry::Assigned(trainer) | Entry::Done(trainer)) => Some(*trainer),
            _ => None,
        }
    }

    /// True when every micro-batch is done: the barrier may run.
    pub fn is_complete(&self) -> bool {
        self.done == self.entries.len()
    }

    pub fn done(&self) -> usize {
        self.done
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn i2_each_micro_batch_counts_once() {
        let mut l = Ledger::new(2);
        l.assign(0, 1).unwrap();
        l.complete(0, 1).unwrap();
        assert_eq!(
            l.complete(0, 1),
            Err(LedgerError::Duplicate {
                micro_batch: 0,
                by: 1
            })
        );
        assert!(!l.is_complete());
        l.assign(1, 0).unwrap();
        assert_eq!(l.done_by(1), None, "assigned, not done");
        l.complete(1, 0).unwrap();
        assert!(l.is_complete());
        assert_eq!(l.done(), 2);
        assert_eq!(
            (l.done_by(0), l.done_by(1), l.done_by(2)),
            (Some(1), Some(0), None)
        );
    }

    #[test]
    fn i2_completion_from_another_trainer_is_refused() {
        let mut l = Ledger::new(1);
        assert!(matches!(
            l.complete(0, 0),
            Err(LedgerError::NotAssigned { .. })
        ));
        l.assign(0, 2).unwrap();
        assert!(matches!(
            l.complete(0, 3),
            Err(LedgerError::NotAssigned { .. })
        ));
        assert!(matches!(
            l.assign(0, 3),
            Err(LedgerError::NotPending { .. })
        ));
        assert!(matches!(
            l.complete(5, 2),
            Err(LedgerError::Unknown {
                micro_batch: 5,
                len: 1
            })
        ));
    }
}
