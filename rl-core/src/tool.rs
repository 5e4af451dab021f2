//! The tool seam of multi-turn rollouts (Search-R1 style): the model writes
//! `<name>arguments</name>`, the rollout stops that row, sends the calls of every row of the turn
//! to the tool together, and appends each [`Observation`]'s text to its row before generation
//! resumes. The text is masked out of the loss: the policy is trained only on what it generated.
//!
//! Implementations live where their transport lives (the retriever client speaks HTTP, the
//! calculator is pure); the rollout in rl-workers only sees this trait.

use std::fmt;

/// What one call returned, ready to be appended to the row that made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    /// The exact text appended to the row (the tool adds its own wrapper, e.g.
    /// `\n<information>…</information>\n`); tokenised and truncated to `max_obs_length` by the
    /// rollout.
    pub text: String,
    /// Whether the call was well formed and answered; false for unparsable arguments, a tool
    /// that is down, a timeout. Counted by `env/valid_action_ratio` and the tool's error metric.
    pub valid: bool,
}

impl Observation {
    /// A successful call's observation.
    pub fn ok(text: impl Into<String>) -> Observation {
        Observation {
            text: text.into(),
            valid: true,
        }
    }

    /// A failed call's observation: the model sees `text` (which says what went wrong), the run
    /// goes on.
    pub fn failed(text: impl Into<String>) -> Observation {
        Observation {
            text: text.into(),
            valid: false,
        }
    }
}

/// A tool the model can call by writing `<name>arguments</name>`.
///
/// `call` never fails the run: a tool that cannot answer returns [`Observation::failed`] for
/// the calls it could not serve, so one flaky retriever does not crash a training step.
pub trait Tool: Send + Sync + fmt::Debug {
    /// The tag name (`search`, `calculator`): the model opens a call with `<name>` and closes it
    /// with `</name>`.
    fn name(&self) -> &str;

    /// Runs all the calls of one turn at once (one HTTP request for a retriever), in order:
    /// `arguments[i]` is the text between the tags of the `i`-th call; the result has exactly
    /// one observation per argument.
    fn call(&self, arguments: &[String]) -> Vec<Observation>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Echo;

    impl Tool for Echo {
        fn name(&self) -> &str {
            "echo"
        }
        fn call(&self, arguments: &[String]) -> Vec<Observation> {
            arguments
                .iter()
                .map(|a| {
                    if a.is_empty() {
                        Observation::failed("<result>empty call</result>")
                    } else {
                        Observation::ok(format!("<result>{a}</result>"))
                    }
                })
                .collect()
        }
    }

    #[test]
    fn a_tool_is_usable_as_a_trait_object_and_answers_each_call_in_order() {
        let tool: Box<dyn Tool> = Box::new(Echo);
        let out = tool.call(&["a".to_owned(), String::new()]);
        assert_eq!(tool.name(), "echo");
        assert_eq!(out[0], Observation::ok("<result>a</result>"));
        assert!(!out[1].valid);
    }
}
