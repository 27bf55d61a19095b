//! A question with its GSM8K-style worked answer: step lines, then a last line `#### <answer>`.
//! Both the generator ([`super::arith`]) and the loader ([`super::gsm8k`]) produce it; as chat
//! ([`Problem::messages`]) the question is the user's turn and the answer the assistant's.

use super::chat::Message;

/// One problem: a question and its worked answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The question, one paragraph.
    pub question: String,
    /// The worked answer; by convention its last `####` is followed by the final answer.
    pub answer: String,
}

impl Problem {
    /// The text after the answer's last `####`, trimmed; `None` when there is no `####` or
    /// nothing follows it. Not normalised (see [`super::reward::extract_answer`]).
    ///
    /// ```
    /// let p = odc_text::Problem { question: "1 + 2?".into(), answer: "1 + 2 = 3\n#### 3".into() };
    /// assert_eq!(p.final_answer(), Some("3"));
    /// ```
    pub fn final_answer(&self) -> Option<&str> {
        let (_, tail) = self.answer.rsplit_once("####")?;
        let tail = tail.trim();
        (!tail.is_empty()).then_some(tail)
    }

    /// The problem as a conversation: the question as the user's turn, the worked answer as the
    /// assistant's (what [`Sample::from_chat`](super::Sample::from_chat) trains on).
    ///
    /// ```
    /// use odc_text::{Message, Problem};
    /// let p = Problem { question: "1 + 2?".into(), answer: "1 + 2 = 3\n#### 3".into() };
    /// assert_eq!(p.messages(), [Message::user("1 + 2?"), Message::assistant("1 + 2 = 3\n#### 3")]);
    /// ```
    pub fn messages(&self) -> Vec<Message> {
        vec![
            Message::user(self.question.clone()),
            Message::assistant(self.answer.clone()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(text: &str) -> Problem {
        Problem {
            question: "q".into(),
            answer: text.into(),
        }
    }

    #[test]
    fn final_answer_is_the_trimmed_text_after_the_last_marker() {
        assert_eq!(answer("2 + 2 = 4\n#### 4").final_answer(), Some("4"));
        assert_eq!(answer("#### 1\n#### 72  \n").final_answer(), Some("72"));
        assert_eq!(answer("no marker").final_answer(), None);
        assert_eq!(answer("ends in ####   ").final_answer(), None);
    }
}
