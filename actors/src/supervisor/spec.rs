//! One validation of a job's configuration, run by the job builder before anything starts and by
//! the supervisor when it starts (a spec can also arrive from another process).

use crate::error::{Error, Result};
use crate::policy::balancer::MAX_TRAINERS;
use crate::supervisor::messages::SupervisorSpec;

impl SupervisorSpec {
    /// Checks the whole spec, naming the first field out of range: at least one and at most
    /// [`MAX_TRAINERS`] trainers and shard servers ([`Error::Zero`] for none), the optimizer's
    /// hyper-parameters, the step's configuration
    /// ([`StepConfig::validate`](crate::policy::step::StepConfig::validate)) and the trainers'
    /// transfers ([`ContextConfig::validate`](crate::trainer::ContextConfig::validate)).
    pub fn validate(&self) -> Result<()> {
        for (what, n) in [("trainer", self.trainers), ("shard server", self.servers)] {
            if n == 0 {
                return Err(Error::Zero { what: what.into() });
            }
        }
        if self.trainers as usize > MAX_TRAINERS || self.servers as usize > MAX_TRAINERS {
            return Err(Error::Config(format!(
                "{} trainers and {} shard servers: at most {MAX_TRAINERS} of each",
                self.trainers, self.servers
            )));
        }
        self.optimizer.validate()?;
        if let Some(plan) = &self.relay {
            plan.check(self.trainers, self.servers)
                .map_err(|e| Error::Config(e.to_string()))?;
        }
        self.step.validate()?;
        self.context.validate()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use odc_transport::Dtype;

    use super::*;
    use crate::policy::dispatch::Communication;
    use crate::policy::recovery::FailurePolicy;
    use crate::policy::step::StepConfig;
    use crate::server::optimizer::OptimizerConfig;
    use crate::trainer::ContextConfig;

    fn spec() -> SupervisorSpec {
        SupervisorSpec {
            trainers: 2,
            servers: 2,
            optimizer: OptimizerConfig::sgd(0.1),
            pull_dtype: Dtype::F32,
            context: ContextConfig::default(),
            step: StepConfig::default(),
            relay: None,
        }
    }

    /// The refusal `change` causes, rendered.
    fn refused(change: impl FnOnce(&mut SupervisorSpec)) -> String {
        let mut s = spec();
        change(&mut s);
        s.validate().expect_err("refused").to_string()
    }

    #[test]
    fn a_default_spec_is_valid() {
        spec().validate().expect("valid");
    }

    #[test]
    fn every_refusal_names_what_was_wrong() {
        type Change = Box<dyn FnOnce(&mut SupervisorSpec)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|s| s.trainers = 0), "trainer"),
            (Box::new(|s| s.servers = 0), "shard server"),
            (
                Box::new(|s| s.trainers = MAX_TRAINERS as u32 + 1),
                "at most",
            ),
            (Box::new(|s| s.optimizer = OptimizerConfig::sgd(-1.0)), "lr"),
            (Box::new(|s| s.step.token_budget = 0), "token budget"),
            (Box::new(|s| s.step.min_fill = 1.5), "fill floor"),
            (Box::new(|s| s.step.clip_norm = Some(f64::NAN)), "clip norm"),
            (Box::new(|s| s.step.clip_norm = Some(0.0)), "clip norm"),
            (
                Box::new(|s| s.step.micro_batch_timeout = Duration::ZERO),
                "micro-batch timeout",
            ),
            (
                Box::new(|s| {
                    s.step.communication = Communication::Collective;
                    s.step.failure = FailurePolicy::Drop;
                }),
                "collective mode needs every trainer",
            ),
            (Box::new(|s| s.context.chunk_elems = 0), "chunk size"),
            (
                Box::new(|s| {
                    s.relay = Some(crate::policy::relay::RelayPlan::even(3, 2, 2).unwrap());
                }),
                "relayed pushes: the plan places 3 trainers, the job has 2",
            ),
            (
                Box::new(|s| s.context.transfer_timeout = Duration::ZERO),
                "transfer timeout",
            ),
        ];
        for (change, names) in cases {
            let message = refused(change);
            assert!(message.contains(names), "{message:?} should name {names:?}");
        }
    }
}
