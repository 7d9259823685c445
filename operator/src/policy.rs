//! The failure policy (`spec.runPolicy.failurePolicy`): how the gang's first failure is judged.
//! Pure: plain data in, a verdict out; [`crate::decide`] turns it into a restart or the end.

use rlplane_api::{ExitCodeOperator, FailureAction, FailurePolicy, FailureRule};

use crate::observe::PodFailure;

/// What a failure leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Restart the gang, counted against `backoffLimit`; `rule` when a rule said so.
    Count {
        /// The index of the rule that matched, if one did.
        rule: Option<usize>,
    },
    /// A disruption no rule matched: restart, counted against `disruptionLimit`.
    Disruption,
    /// Restart the gang without counting it (rule `rule`, action Ignore).
    Ignore {
        /// The index of the rule.
        rule: usize,
    },
    /// Fail the job now (rule `rule`, action FailJob).
    FailJob {
        /// The index of the rule.
        rule: usize,
    },
}

/// The verdict on `failure`: the first rule that matches decides; without one, a disruption
/// counts against `disruptionLimit` and anything else against `backoffLimit`.
pub fn judge(policy: &FailurePolicy, failure: &PodFailure) -> Verdict {
    match policy.rules.iter().position(|r| matches(r, failure)) {
        Some(i) => match policy.rules[i].action {
            FailureAction::Ignore => Verdict::Ignore { rule: i },
            FailureAction::Count => Verdict::Count { rule: Some(i) },
            FailureAction::FailJob => Verdict::FailJob { rule: i },
        },
        None if failure.disruption() => Verdict::Disruption,
        None => Verdict::Count { rule: None },
    }
}

/// `failurePolicy rule <i>: <action>`, for messages.
pub fn rule_clause(policy: &FailurePolicy, rule: usize) -> String {
    format!("failurePolicy rule {rule}: {:?}", policy.rules[rule].action)
}

fn matches(rule: &FailureRule, failure: &PodFailure) -> bool {
    if let Some(m) = &rule.on_exit_codes {
        return failure.exit_codes.iter().any(|(container, code)| {
            m.container_name.as_ref().is_none_or(|n| n == container)
                && match m.operator {
                    ExitCodeOperator::In => m.values.contains(code),
                    ExitCodeOperator::NotIn => !m.values.contains(code),
                }
        });
    }
    if let Some(conds) = &rule.on_pod_conditions {
        return conds.iter().any(|c| failure.conditions.contains(&c.type_));
    }
    false
}

#[cfg(test)]
mod tests {
    use rlplane_api::{ExitCodesMatcher, PodConditionMatcher};

    use super::*;
    use crate::observe::FailureKind;

    fn failure(kind: FailureKind, exit_codes: &[(&str, i32)], conditions: &[&str]) -> PodFailure {
        PodFailure {
            kind,
            detail: String::new(),
            at: None,
            exit_codes: exit_codes.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
            conditions: conditions.iter().map(|c| c.to_string()).collect(),
        }
    }

    fn codes(
        action: FailureAction,
        container: Option<&str>,
        operator: ExitCodeOperator,
        values: &[i32],
    ) -> FailureRule {
        FailureRule {
            action,
            on_exit_codes: Some(ExitCodesMatcher {
                container_name: container.map(str::to_string),
                operator,
                values: values.to_vec(),
            }),
            on_pod_conditions: None,
        }
    }

    #[test]
    fn without_rules_disruptions_have_their_own_count_and_the_rest_counts() {
        let p = FailurePolicy::default();
        assert_eq!(p.disruption_limit, 10);
        assert_eq!(judge(&p, &failure(FailureKind::PodEvicted, &[], &["DisruptionTarget"])), Verdict::Disruption);
        assert_eq!(judge(&p, &failure(FailureKind::ContainerFailed, &[("w", 1)], &[])), Verdict::Count { rule: None });
        assert_eq!(judge(&p, &failure(FailureKind::PodDeleted, &[], &[])), Verdict::Count { rule: None });
    }

    #[test]
    fn the_first_matching_rule_decides() {
        let p = FailurePolicy {
            disruption_limit: 10,
            rules: vec![
                codes(FailureAction::FailJob, Some("trainer"), ExitCodeOperator::In, &[42]),
                codes(FailureAction::Ignore, None, ExitCodeOperator::In, &[137, 42]),
                FailureRule {
                    action: FailureAction::Count,
                    on_exit_codes: None,
                    on_pod_conditions: Some(vec![PodConditionMatcher { type_: "DisruptionTarget".into() }]),
                },
            ],
        };
        let f = |codes: &[(&str, i32)], conds: &[&str]| failure(FailureKind::ContainerFailed, codes, conds);
        assert_eq!(judge(&p, &f(&[("trainer", 42)], &[])), Verdict::FailJob { rule: 0 });
        assert_eq!(
            judge(&p, &f(&[("rlplane-worker", 42)], &[])),
            Verdict::Ignore { rule: 1 },
            "rule 0 names another container"
        );
        assert_eq!(judge(&p, &f(&[("trainer", 137)], &[])), Verdict::Ignore { rule: 1 });
        assert_eq!(
            judge(&p, &failure(FailureKind::PodEvicted, &[], &["DisruptionTarget"])),
            Verdict::Count { rule: Some(2) }
        );
        assert_eq!(judge(&p, &f(&[("trainer", 1)], &[])), Verdict::Count { rule: None });
        assert_eq!(rule_clause(&p, 1), "failurePolicy rule 1: Ignore");
    }

    #[test]
    fn not_in_matches_any_other_non_zero_code() {
        let p = FailurePolicy {
            disruption_limit: 10,
            rules: vec![codes(FailureAction::FailJob, None, ExitCodeOperator::NotIn, &[1, 137])],
        };
        assert_eq!(judge(&p, &failure(FailureKind::ContainerFailed, &[("w", 3)], &[])), Verdict::FailJob { rule: 0 });
        assert_eq!(
            judge(&p, &failure(FailureKind::ContainerFailed, &[("w", 137)], &[])),
            Verdict::Count { rule: None }
        );
        // A pod deleted with no container failed has no code to match.
        assert_eq!(judge(&p, &failure(FailureKind::PodDeleted, &[], &[])), Verdict::Count { rule: None });
    }
}
