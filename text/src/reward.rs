//! GRPO rewards for GSM8K-style answers, read from the last `####`.
//!
//! Guarantees (the tests are named after them):
//!
//! 1. **Last marker wins**: only the number after the last `####` counts.
//! 2. **Normalised**: the number `[-][$]digits[,digits…][.digits]` (or `$-…`) is compared with
//!    commas and `$` removed, leading zeros and trailing fractional zeros dropped (`$1,000.50` →
//!    `1000.5`, `12.0` → `12`, `-0` → `0`). Text after the number does not change the answer.
//! 3. **Format is strict**: [`format_reward`] is 1 only when the last `####` starts a line and the
//!    number after it ends the text (trailing whitespace aside).
//! 4. **Bounded**: [`reward()`] = [`EXACT_MATCH_WEIGHT`] × exact match + [`FORMAT_WEIGHT`] × format,
//!    so it lies in `[0, 1.1]`; the format term is a small shaping bonus that never outweighs a
//!    right answer.

/// The weight of a correct final answer in [`reward()`].
pub const EXACT_MATCH_WEIGHT: f64 = 1.0;
/// The weight of a well-formed `#### <number>` ending in [`reward()`].
pub const FORMAT_WEIGHT: f64 = 0.1;

/// The raw number after the last `####` and the text after that number.
fn last_number(text: &str) -> Option<(&str, &str)> {
    let (_, tail) = text.rsplit_once("####")?;
    let tail = tail.trim_start();
    let bytes = tail.as_bytes();
    let mut end = 0;
    // Sign and dollar in either order: `-$5`, `$-5`, `-5`, `$5`.
    for _ in 0..2 {
        if matches!(bytes.get(end), Some(b'-' | b'$')) && !tail[..end].contains(bytes[end] as char)
        {
            end += 1;
        }
    }
    let digits_start = end;
    while matches!(bytes.get(end), Some(b'0'..=b'9')) {
        end += 1;
    }
    if end == digits_start {
        return None;
    }
    // Thousands groups, then one fractional part.
    while bytes.get(end) == Some(&b',') && matches!(bytes.get(end + 1), Some(b'0'..=b'9')) {
        end += 1;
        while matches!(bytes.get(end), Some(b'0'..=b'9')) {
            end += 1;
        }
    }
    if bytes.get(end) == Some(&b'.') && matches!(bytes.get(end + 1), Some(b'0'..=b'9')) {
        end += 1;
        while matches!(bytes.get(end), Some(b'0'..=b'9')) {
            end += 1;
        }
    }
    Some(tail.split_at(end))
}

/// `raw` (as matched by [`last_number`]) without `$`, commas, leading zeros or trailing
/// fractional zeros.
fn normalise(raw: &str) -> String {
    let negative = raw.contains('-');
    let digits: String = raw
        .chars()
        .filter(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let (whole, fraction) = digits.split_once('.').unwrap_or((&digits, ""));
    let whole = whole.trim_start_matches('0');
    let whole = if whole.is_empty() { "0" } else { whole };
    let fraction = fraction.trim_end_matches('0');
    let magnitude = if fraction.is_empty() {
        whole.to_string()
    } else {
        format!("{whole}.{fraction}")
    };
    if negative && magnitude != "0" {
        format!("-{magnitude}")
    } else {
        magnitude
    }
}

/// The normalised number after the last `####` in `text`, if one follows it.
///
/// ```
/// use odc_text::extract_answer;
/// assert_eq!(extract_answer("so 2 * 3 = 6\n#### $1,006.0").as_deref(), Some("1006"));
/// assert_eq!(extract_answer("no marker 6"), None);
/// ```
pub fn extract_answer(text: &str) -> Option<String> {
    last_number(text).map(|(raw, _)| normalise(raw))
}

/// Whether `generated`'s final answer equals `reference`'s. The reference is a worked answer with
/// a `####` line or a bare number.
pub fn exact_match(generated: &str, reference: &str) -> bool {
    let reference = extract_answer(reference).or_else(|| {
        last_number(&format!("####{reference}"))
            .filter(|(_, rest)| rest.trim().is_empty())
            .map(|(raw, _)| normalise(raw))
    });
    match (extract_answer(generated), reference) {
        (Some(generated), Some(reference)) => generated == reference,
        _ => false,
    }
}

/// 1.0 when `generated` ends with a line `#### <number>` and nothing after the number (trailing
/// whitespace aside), else 0.0.
pub fn format_reward(generated: &str) -> f64 {
    let Some((before, _)) = generated.rsplit_once("####") else {
        return 0.0;
    };
    let line_start = before
        .rsplit('\n')
        .next()
        .is_some_and(|line| line.trim().is_empty());
    match last_number(generated) {
        Some((_, rest)) if line_start && rest.trim().is_empty() => 1.0,
        _ => 0.0,
    }
}

/// [`EXACT_MATCH_WEIGHT`] × [`exact_match`] + [`FORMAT_WEIGHT`] × [`format_reward`].
///
/// ```
/// use odc_text::reward;
/// assert_eq!(reward("3 + 4 = 7\n#### 7", "#### 7"), 1.1);
/// assert_eq!(reward("#### 8", "#### 7"), 0.1);
/// assert_eq!(reward("it is 7", "#### 7"), 0.0);
/// ```
pub fn reward(generated: &str, reference: &str) -> f64 {
    weighted_reward(generated, reference, FORMAT_WEIGHT)
}

/// [`reward`] with another weight for the format (0: correctness only). In a group where no
/// response is right, group normalisation scales a format difference alone to the size of a right
/// answer's advantage.
///
/// ```
/// use odc_text::weighted_reward;
/// assert_eq!(weighted_reward("#### 8", "#### 7", 0.0), 0.0);
/// assert_eq!(weighted_reward("#### 7", "#### 7", 0.0), 1.0);
/// assert_eq!(weighted_reward("#### 8", "#### 7", 0.5), 0.5);
/// ```
pub fn weighted_reward(generated: &str, reference: &str, format_weight: f64) -> f64 {
    let exact = if exact_match(generated, reference) {
        1.0
    } else {
        0.0
    };
    EXACT_MATCH_WEIGHT * exact + format_weight * format_reward(generated)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ArithTask;

    #[test]
    fn normalised_numbers_compare_equal() {
        let cases = [
            ("#### 72", Some("72")),
            ("#### 1,234", Some("1234")),
            ("#### $18", Some("18")),
            ("#### $1,000.50", Some("1000.5")),
            ("#### 12.0", Some("12")),
            ("#### 12.", Some("12")),
            ("#### -5", Some("-5")),
            ("#### -$5", Some("-5")),
            ("#### $-5", Some("-5")),
            ("#### -0", Some("0")),
            ("#### 007", Some("7")),
            ("#### 0.25", Some("0.25")),
            ("####\n  42  \n", Some("42")),
            ("#### 42 apples", Some("42")),
            ("#### ,5", None),
            ("#### $", None),
            ("#### -", None),
            ("#### seven", None),
            ("the answer is 7", None),
            ("", None),
        ];
        for (text, expected) in cases {
            assert_eq!(extract_answer(text).as_deref(), expected, "{text:?}");
        }
    }

    #[test]
    fn last_marker_wins() {
        assert_eq!(
            extract_answer("#### 3\nno wait\n#### 4").as_deref(),
            Some("4")
        );
        assert!(exact_match("#### 3\n#### 4", "#### 4"));
        assert!(!exact_match("#### 4\n#### 3", "#### 4"));
        // A last marker with no number is no answer, even if an earlier one had one.
        assert_eq!(extract_answer("#### 4\n####"), None);
    }

    #[test]
    fn exact_match_right_wrong_missing_commas_negative_whitespace() {
        assert!(
            exact_match("2 + 3 = 5\n#### 5", "2 + 3 = 5\n#### 5"),
            "right"
        );
        assert!(!exact_match("#### 6", "#### 5"), "wrong");
        assert!(!exact_match("the answer is 5", "#### 5"), "missing ####");
        assert!(exact_match("#### 5 apples", "#### 5"), "extra text");
        assert!(exact_match("#### 1,000", "#### 1000"), "commas");
        assert!(exact_match("#### -12", "-12"), "negative, bare reference");
        assert!(!exact_match("#### 12", "#### -12"), "sign matters");
        assert!(exact_match("  ####   7 \n\n", " 7 "), "whitespace");
        assert!(exact_match("#### 7.0", "#### 7"), "trailing .0");
        assert!(
            !exact_match("#### 7", "seven"),
            "a reference without a number matches nothing"
        );
        assert!(
            !exact_match("#### 7", "7 apples"),
            "a bare reference is only a number"
        );
        assert!(!exact_match("", ""));
    }

    #[test]
    fn format_is_strict_marker_at_line_start_and_number_at_the_end() {
        assert_eq!(format_reward("2 + 3 = 5\n#### 5"), 1.0);
        assert_eq!(format_reward("#### 5"), 1.0);
        assert_eq!(format_reward("2 + 3 = 5\n  #### -1,005.5 \n\n"), 1.0);
        assert_eq!(format_reward("2 + 3 = 5\n#### 5 apples"), 0.0, "extra text");
        assert_eq!(format_reward("#### 5."), 0.0, "extra period");
        assert_eq!(format_reward("so #### 5"), 0.0, "not at a line start");
        assert_eq!(format_reward("the answer is 5"), 0.0, "missing ####");
        assert_eq!(format_reward("#### five"), 0.0, "not a number");
        assert_eq!(format_reward("#### 5\n#### "), 0.0, "last marker empty");
    }

    #[test]
    fn bounded_reward_weights_exact_match_over_format() {
        assert_eq!(reward("1 + 1 = 2\n#### 2", "#### 2"), 1.1);
        assert_eq!(reward("#### 2 apples", "#### 2"), 1.0);
        assert_eq!(reward("#### 3", "#### 2"), 0.1);
        assert_eq!(reward("2", "#### 2"), 0.0);
    }

    #[test]
    fn generated_reference_answers_earn_the_full_reward() {
        for p in ArithTask::train(8).problems(0..200) {
            assert_eq!(reward(&p.answer, &p.answer), 1.1, "{}", p.answer);
            let final_answer = p.final_answer().expect("a final answer");
            assert!(exact_match(&p.answer, final_answer));
        }
    }
}
