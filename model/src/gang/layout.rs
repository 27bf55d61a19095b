//! Where a gang's tokens sit in a split sample: the zig-zag cut of `odc_policy::split::zigzag`,
//! member `m` of `k` holding chunks `m` and `2k − 1 − m` (balanced causal work).

use std::ops::Range;

use crate::error::{Error, Result};

/// Where a gang's tokens sit in the split sample: every member's two chunks, and which member
/// this one is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangLayout {
    chunks: Vec<[Range<usize>; 2]>,
    member: usize,
}

impl GangLayout {
    /// The zig-zag cut of a sample of `tokens` for a gang of `members`, seen by `member`.
    pub fn zigzag(tokens: usize, members: usize, member: usize) -> Result<Self> {
        let bad = |reason: String| Error::Gang(reason);
        let members_u32 = u32::try_from(members)
            .map_err(|_| bad(format!("a gang of {members} members is too large")))?;
        let cut = odc_policy::split::zigzag(tokens as u64, members_u32)
            .map_err(|e| bad(e.to_string()))?;
        if member >= members {
            return Err(bad(format!("no member {member} in a gang of {members}")));
        }
        let chunks = cut
            .into_iter()
            .map(|[a, b]| {
                [
                    a.start as usize..a.end as usize,
                    b.start as usize..b.end as usize,
                ]
            })
            .collect();
        Ok(GangLayout { chunks, member })
    }

    /// This member's index.
    pub fn member(&self) -> usize {
        self.member
    }

    /// Members of the gang.
    pub fn members(&self) -> usize {
        self.chunks.len()
    }

    /// Member `m`'s two chunks (positions in the sample), in order.
    pub fn chunks(&self, m: usize) -> &[Range<usize>; 2] {
        &self.chunks[m]
    }

    /// Tokens member `m` holds.
    pub fn len_of(&self, m: usize) -> usize {
        self.chunks[m].iter().map(|r| r.len()).sum()
    }

    /// The positions in the sample of this member's tokens, in its local order (its first chunk,
    /// then its second).
    pub fn positions(&self) -> Vec<usize> {
        self.chunks[self.member]
            .iter()
            .flat_map(|r| r.clone())
            .collect()
    }
}
