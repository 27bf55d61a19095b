//! Fault injection for tests: delays a test installs ([`install`]) so that it can kill a process
//! at a known point. The server and its relays only read what is installed ([`installed`]); an
//! uninstalled fault waits nothing, and nothing here is installed unless a program asks.
//!
//! - `checkpoint_write_delay` holds every checkpoint write after its copy is taken;
//! - `relay_flush_delay` holds every relay flush (early or at the barrier) after its sums are
//!   taken and before they are sent.
//!
//! A test in another process (`tests/multiprocess/restart.rs`) cannot install a hook itself: it
//! sets `ODC_CHECKPOINT_WRITE_DELAY_MS` / `ODC_RELAY_FLUSH_DELAY_MS` for the launched program,
//! whose entry installs [`Faults::from_env`] (odc's recipes do, in `Process::start`).

use std::sync::RwLock;
use std::time::Duration;

/// The delays installed for this process (see the [module docs](self)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    pub checkpoint_write_delay: Option<Duration>,
    pub relay_flush_delay: Option<Duration>,
}

/// The longest delay a fault holds anything for.
pub const MAX_DELAY: Duration = Duration::from_secs(60);

static INSTALLED: RwLock<Faults> = RwLock::new(Faults {
    checkpoint_write_delay: None,
    relay_flush_delay: None,
});

/// Installs `faults` for this process (replacing what was installed).
pub fn install(faults: Faults) {
    *INSTALLED.write().unwrap_or_else(|e| e.into_inner()) = faults;
}

/// What is installed (none by default).
pub fn installed() -> Faults {
    *INSTALLED.read().unwrap_or_else(|e| e.into_inner())
}

impl Faults {
    /// The delays the multi-process tests ask a launched program for, in milliseconds (at most
    /// [`MAX_DELAY`]): `ODC_CHECKPOINT_WRITE_DELAY_MS`, `ODC_RELAY_FLUSH_DELAY_MS`. Unset or not
    /// a number, none.
    pub fn from_env() -> Faults {
        Faults::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`Faults::from_env`] over any lookup of variables.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Faults {
        let delay = |name: &str| {
            let ms = lookup(name)?.parse::<u64>().ok()?;
            Some(Duration::from_millis(ms).min(MAX_DELAY))
        };
        Faults {
            checkpoint_write_delay: delay("ODC_CHECKPOINT_WRITE_DELAY_MS"),
            relay_flush_delay: delay("ODC_RELAY_FLUSH_DELAY_MS"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_come_from_the_variables_bounded_and_nothing_is_installed_by_default() {
        assert_eq!(installed(), Faults::default());
        let faults = Faults::from_lookup(|name| match name {
            "ODC_CHECKPOINT_WRITE_DELAY_MS" => Some("3000".into()),
            "ODC_RELAY_FLUSH_DELAY_MS" => Some("99999999".into()),
            _ => None,
        });
        assert_eq!(faults.checkpoint_write_delay, Some(Duration::from_secs(3)));
        assert_eq!(faults.relay_flush_delay, Some(MAX_DELAY));
        assert_eq!(
            Faults::from_lookup(|_| Some("soon".into())),
            Faults::default()
        );
    }
}
