//! A built-in generator of grade-school arithmetic word problems with worked answers in GSM8K
//! style: one line per step (`Maya buys 3 bags of apples with 4 apples in each bag, so she buys
//! 3 * 4 = 12 apples.`), then `#### <result>`.
//!
//! Guarantees (the tests are named after them):
//!
//! 1. **Deterministic**: a problem is a pure function of (seed, split, index), computed with a
//!    private SplitMix64 and integer arithmetic only, so it is the same on every platform and run.
//! 2. **Exact**: every step line `a op b = c` is correct integer arithmetic (`+`, `-`, `*`, `/`
//!    with no remainder), every number lies in `2..=`[`MAX_VALUE`] (ages in `2..=120`; never 0 or
//!    1, so every count reads as a plural) — or within the smaller bound of
//!    [`ArithTask::with_max_value`] —, each step starts from the previous result, and the `####`
//!    line repeats the last result.
//! 3. **Long-tailed**: a problem has 1 to [`MAX_STEPS`] steps with `P(n) ∝ n^-1.5` (about half have
//!    one step, three quarters at most three, one in ten seven or more), so token lengths vary
//!    several-fold — the imbalance odc's balancer exists for.
//! 4. **Restated**: each step line restates its sentence of the question, then computes
//!    (`Liam puts 5 more buttons in the jar, so the jar now holds 44 + 5 = 49 buttons.`), so every
//!    number an equation needs is in its own line or the line above.
//! 5. **Held out**: a question belongs to the split its text hashes to (one in eight to eval),
//!    so the train and eval splits never share a question.
//!
//! Phrasing is regular and numbers are small so that a tiny model can learn the task.

use std::ops::Range;

use super::problem::Problem;

/// The most steps a problem has.
pub const MAX_STEPS: usize = 12;
/// The largest number in a problem by default (ages stay at or below 120).
pub const MAX_VALUE: u64 = 1000;
/// The smallest bound [`ArithTask::with_max_value`] accepts.
pub const MIN_MAX_VALUE: u64 = 20;
/// The oldest age in an ages problem.
const MAX_AGE: u64 = 120;
/// One question in this many (by hash of its text) belongs to the eval split.
const EVAL_ONE_IN: u64 = 8;
/// `P(n) ∝ n^-1.5` for n = 1..=12, in thousandths (integers, so every platform draws alike).
const STEP_WEIGHTS: [u64; MAX_STEPS] = [1000, 354, 192, 125, 89, 68, 54, 44, 37, 32, 27, 24];

/// Which side of the held-out split a task draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Seven in eight questions.
    Train,
    /// One in eight questions, disjoint from [`Split::Train`].
    Eval,
}

/// An endless, indexable stream of arithmetic problems of one split.
///
/// ```
/// use odc_text::ArithTask;
/// let p = ArithTask::train(7).problem(0);
/// assert_eq!(p, ArithTask::train(7).problem(0));
/// assert!(p.answer.lines().last().unwrap().starts_with("#### "));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArithTask {
    seed: u64,
    split: Split,
    max_value: u64,
}

impl ArithTask {
    /// The training split of `seed`'s problems.
    pub fn train(seed: u64) -> Self {
        ArithTask {
            seed,
            split: Split::Train,
            max_value: MAX_VALUE,
        }
    }

    /// The held-out split of `seed`'s problems; it shares no question with [`ArithTask::train`].
    pub fn eval(seed: u64) -> Self {
        ArithTask {
            seed,
            split: Split::Eval,
            max_value: MAX_VALUE,
        }
    }

    /// Which split this task draws from.
    pub fn split(&self) -> Split {
        self.split
    }

    /// The same task with every number at most `max` (clamped into
    /// [`MIN_MAX_VALUE`]`..=`[`MAX_VALUE`]): the factors of a product at most `⌊√max⌋` (and 12),
    /// opening amounts at most `max` (and 60), ages at most `max` (and 120). Smaller bounds leave
    /// fewer arithmetic facts to learn; the wording, the step counts and the split rule stay.
    /// [`MAX_VALUE`] gives the default task, problem for problem.
    ///
    /// ```
    /// use odc_text::ArithTask;
    /// let easy = ArithTask::train(7).with_max_value(20);
    /// assert_eq!(easy.max_value(), 20);
    /// assert_eq!(ArithTask::train(7).with_max_value(1000), ArithTask::train(7));
    /// ```
    pub fn with_max_value(mut self, max: u64) -> Self {
        self.max_value = max.clamp(MIN_MAX_VALUE, MAX_VALUE);
        self
    }

    /// The largest number a problem of this task holds.
    pub fn max_value(&self) -> u64 {
        self.max_value
    }

    /// Problem number `index` of this split.
    pub fn problem(&self, index: u64) -> Problem {
        // Draw until the question hashes to this split: about 1.14 draws for train, 8 for eval.
        let mut attempt = 0u64;
        loop {
            let problem = generate(&mut Rng::new(self.seed, index, attempt), self.max_value);
            if split_of(&problem.question) == self.split {
                return problem;
            }
            attempt += 1;
        }
    }

    /// The problems with indices in `range`, in order.
    pub fn problems(&self, range: Range<u64>) -> impl Iterator<Item = Problem> {
        let task = *self;
        range.map(move |index| task.problem(index))
    }
}

/// The split a question belongs to: FNV-1a of its bytes, one in [`EVAL_ONE_IN`] to eval.
fn split_of(question: &str) -> Split {
    let hash = question.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    if mix(hash) % EVAL_ONE_IN == 0 {
        Split::Eval
    } else {
        Split::Train
    }
}

/// SplitMix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64 keyed by (seed, index, attempt).
struct Rng(u64);

impl Rng {
    fn new(seed: u64, index: u64, attempt: u64) -> Self {
        Rng(mix(mix(seed ^ mix(index)) ^ mix(attempt ^ 0x5eed)))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `lo..=hi` (`lo <= hi`); the modulo bias is below 2^-50 for these small ranges.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.next() as usize % items.len()]
    }
}

/// Draws a step count from [`STEP_WEIGHTS`].
fn draw_steps(rng: &mut Rng) -> usize {
    let total: u64 = STEP_WEIGHTS.iter().sum();
    let mut draw = rng.next() % total;
    for (n, &weight) in STEP_WEIGHTS.iter().enumerate() {
        if draw < weight {
            return n + 1;
        }
        draw -= weight;
    }
    MAX_STEPS
}

/// One arithmetic operation of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
}

impl Op {
    fn symbol(self) -> char {
        match self {
            Op::Add => '+',
            Op::Sub => '-',
            Op::Mul => '*',
            Op::Div => '/',
        }
    }
}

/// A step from `a` (in `2..=max`): an operation, its operand and the result, both in `2..=max`
/// too, so that every count reads as a plural.
fn draw_op(rng: &mut Rng, a: u64, max: u64) -> (Op, u64, u64) {
    let divisors: Vec<u64> = (2..=5).filter(|k| a % k == 0 && a / k >= 2).collect();
    let mut feasible = Vec::with_capacity(4);
    if a + 2 <= max {
        feasible.push(Op::Add);
    }
    if a >= 4 {
        feasible.push(Op::Sub);
    }
    if a * 2 <= max {
        feasible.push(Op::Mul);
    }
    if !divisors.is_empty() {
        feasible.push(Op::Div);
    }
    // With max >= 6, Add (a <= max - 2) or Sub (a >= 4) is always feasible.
    let op = *rng.pick(&feasible);
    match op {
        Op::Add => {
            let b = rng.range(2, (max - a).min(50));
            (op, b, a + b)
        }
        Op::Sub => {
            let b = rng.range(2, (a - 2).min(50));
            (op, b, a - b)
        }
        Op::Mul => {
            let b = rng.range(2, (max / a).min(5));
            (op, b, a * b)
        }
        Op::Div => {
            let b = *rng.pick(&divisors);
            (op, b, a / b)
        }
    }
}

/// A person: name and pronouns.
struct Person {
    name: &'static str,
    /// Subject pronoun, capitalised.
    he: &'static str,
    /// Subject pronoun.
    he_lower: &'static str,
    /// Possessive pronoun.
    his: &'static str,
}

const fn person(name: &'static str, female: bool) -> Person {
    if female {
        Person {
            name,
            he: "She",
            he_lower: "she",
            his: "her",
        }
    } else {
        Person {
            name,
            he: "He",
            he_lower: "he",
            his: "his",
        }
    }
}

const PEOPLE: [Person; 10] = [
    person("Maya", true),
    person("Liam", false),
    person("Ava", true),
    person("Noah", false),
    person("Sofia", true),
    person("Ethan", false),
    person("Zoe", true),
    person("Omar", false),
    person("Lena", true),
    person("Ravi", false),
];

const RELATIVES: [&str; 14] = [
    "brother",
    "sister",
    "cousin",
    "aunt",
    "uncle",
    "neighbor",
    "teacher",
    "coach",
    "friend",
    "grandmother",
    "grandfather",
    "babysitter",
    "doctor",
    "dentist",
];

/// The story a problem tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Theme {
    /// Buying and giving away items.
    Shopping,
    /// Items put into and taken out of a jar.
    Jar,
    /// Money earned and spent.
    Savings,
    /// Items made by machines per hour.
    Factory,
    /// A chain of relatives' ages.
    Ages,
}

const THEMES: [Theme; 5] = [
    Theme::Shopping,
    Theme::Jar,
    Theme::Savings,
    Theme::Factory,
    Theme::Ages,
];

impl Theme {
    fn items(self) -> &'static [&'static str] {
        match self {
            Theme::Shopping => &[
                "apples", "oranges", "pencils", "stickers", "eggs", "crayons",
            ],
            Theme::Jar => &["candies", "marbles", "buttons", "shells", "beads", "coins"],
            Theme::Savings => &["dollars"],
            Theme::Factory => &["toys", "bottles", "boxes", "cakes", "shirts", "chairs"],
            Theme::Ages => &["years"],
        }
    }

    /// The largest number of this theme under the task's bound `max_value`.
    fn max(self, max_value: u64) -> u64 {
        match self {
            Theme::Ages => MAX_AGE.min(max_value),
            _ => max_value,
        }
    }
}

/// Generates one problem from `rng` with numbers at most `max_value` (at least
/// [`MIN_MAX_VALUE`]).
fn generate(rng: &mut Rng, max_value: u64) -> Problem {
    let theme = *rng.pick(&THEMES);
    let steps = draw_steps(rng);
    let p = rng.pick(&PEOPLE);
    let item = *rng.pick(theme.items());
    let max = theme.max(max_value);
    // Factors of the opening product: 2..=12, and their product within `max`.
    let factor = max.isqrt().min(12);
    let (name, he, she, his) = (p.name, p.he, p.he_lower, p.his);

    let mut question = Vec::with_capacity(steps + 2);
    let mut lines = Vec::with_capacity(steps + 1);

    // The opening: Shopping and Factory open with a product, which is the first step.
    let (mut value, ops) = match theme {
        Theme::Shopping | Theme::Factory => {
            let (x, y) = (rng.range(2, factor), rng.range(2, factor));
            let a = x * y;
            if theme == Theme::Shopping {
                let ask = format!("{name} buys {x} bags of {item} with {y} {item} in each bag.");
                lines.push(restated(
                    &ask,
                    &format!("{she} buys {x} * {y} = {a} {item}."),
                ));
                question.push(ask);
            } else {
                let ask = format!("A machine makes {x} {item} every hour and runs for {y} hours.");
                lines.push(restated(&ask, &format!("it makes {x} * {y} = {a} {item}.")));
                question.push(ask);
            }
            (a, steps - 1)
        }
        Theme::Jar => {
            let a = rng.range(2, max.min(60));
            question.push(format!("A jar holds {a} {item}."));
            (a, steps)
        }
        Theme::Savings => {
            let a = rng.range(2, max.min(60));
            question.push(format!("{name} has {a} dollars in {his} piggy bank."));
            (a, steps)
        }
        Theme::Ages => {
            let a = rng.range(4, max.min(40));
            question.push(format!("{name} is {a} years old."));
            (a, steps)
        }
    };

    // Ages: each step is a new relative, described relative to the previous person.
    let mut relatives = RELATIVES;
    let mut previous = name.to_string();
    for step in 0..ops {
        let (op, b, c) = draw_op(rng, value, max);
        let a = value;
        let s = op.symbol();
        let (ask, line) = match theme {
            Theme::Shopping => match op {
                Op::Add => (
                    format!("{he} then buys {b} more {item}."),
                    format!("{he} has {a} {s} {b} = {c} {item}."),
                ),
                Op::Sub => (
                    format!("{he} gives {b} {item} to a friend."),
                    format!("{he} has {a} {s} {b} = {c} {item}."),
                ),
                Op::Mul => (
                    format!("Next, {she} buys enough to have {b} times as many {item}."),
                    format!("{he} now has {a} {s} {b} = {c} {item}."),
                ),
                Op::Div => (
                    format!("{he} splits the {item} into {b} equal groups and keeps one group."),
                    format!("One group has {a} {s} {b} = {c} {item}."),
                ),
            },
            Theme::Jar => match op {
                Op::Add => (
                    format!("{name} puts {b} more {item} in the jar."),
                    format!("The jar now holds {a} {s} {b} = {c} {item}."),
                ),
                Op::Sub => (
                    format!("{name} takes {b} {item} out of the jar."),
                    format!("That leaves {a} {s} {b} = {c} {item} in the jar."),
                ),
                Op::Mul => (
                    format!("{name} adds {item} until the jar holds {b} times as many."),
                    format!("The jar now holds {a} {s} {b} = {c} {item}."),
                ),
                Op::Div => (
                    format!("{name} divides the {item} equally into {b} jars and keeps one jar."),
                    format!("Each jar holds {a} {s} {b} = {c} {item}."),
                ),
            },
            Theme::Savings => match op {
                Op::Add => (
                    format!("{he} earns {b} dollars doing chores."),
                    format!("{he} has {a} {s} {b} = {c} dollars."),
                ),
                Op::Sub => (
                    format!("{he} spends {b} dollars on a book."),
                    format!("{he} has {a} {s} {b} = {c} dollars."),
                ),
                Op::Mul => (
                    format!("A gift makes {his} money {b} times as much."),
                    format!("{he} now has {a} {s} {b} = {c} dollars."),
                ),
                Op::Div => (
                    format!("{he} splits {his} money equally into {b} envelopes and keeps one."),
                    format!("One envelope holds {a} {s} {b} = {c} dollars."),
                ),
            },
            Theme::Factory => match op {
                Op::Add => (
                    format!("Another machine makes {b} more {item}."),
                    format!("Together that is {a} {s} {b} = {c} {item}."),
                ),
                Op::Sub => (
                    format!("Then {b} {item} fail the check and are thrown away."),
                    format!("That leaves {a} {s} {b} = {c} {item}."),
                ),
                Op::Mul => (
                    format!("The factory keeps going until it has {b} times as many {item}."),
                    format!("It has {a} {s} {b} = {c} {item}."),
                ),
                Op::Div => (
                    format!("The {item} are packed equally into {b} trucks; count one truck."),
                    format!("One truck carries {a} {s} {b} = {c} {item}."),
                ),
            },
            Theme::Ages => {
                // Partial Fisher–Yates: the first `step + 1` relatives are distinct.
                let pick = rng.range(step as u64, relatives.len() as u64 - 1) as usize;
                relatives.swap(step, pick);
                let relative = relatives[step];
                let ask = match op {
                    Op::Add => {
                        format!("{name}'s {relative} is {b} years older than {previous}.")
                    }
                    Op::Sub => {
                        format!("{name}'s {relative} is {b} years younger than {previous}.")
                    }
                    Op::Mul => format!("{name}'s {relative} is {b} times as old as {previous}."),
                    Op::Div => format!(
                        "{} is {b} times as old as {name}'s {relative}.",
                        capitalised(&previous)
                    ),
                };
                previous = format!("the {relative}");
                (
                    ask,
                    format!("The {relative} is {a} {s} {b} = {c} years old."),
                )
            }
        };
        lines.push(restated(&ask, &line));
        question.push(ask);
        value = c;
    }

    question.push(match theme {
        Theme::Shopping => format!("How many {item} does {name} have at the end?"),
        Theme::Jar => format!("How many {item} are in the jar at the end?"),
        Theme::Savings => format!("How many dollars does {name} have now?"),
        Theme::Factory => format!("How many {item} are there at the end?"),
        Theme::Ages if ops == 0 => format!("How old is {name}?"),
        Theme::Ages => format!("How old is {name}'s {}?", &previous["the ".len()..]),
    });
    lines.push(format!("#### {value}"));
    Problem {
        question: question.join(" "),
        answer: lines.join("\n"),
    }
}

/// A step's answer line: its sentence of the question restated, then ", so " and the
/// computation (`Liam puts 5 more buttons in the jar, so the jar now holds 44 + 5 = 49 buttons.`).
/// Every number the equation needs is then in its own line or the line above, which a small
/// model copies far sooner than it finds the k-th sentence of a question by content.
fn restated(ask: &str, computation: &str) -> String {
    format!(
        "{}, so {}",
        ask.trim_end_matches('.'),
        decapitalised(computation)
    )
}

/// `text` with its first letter in lower case.
fn decapitalised(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// `text` with its first letter in upper case.
fn capitalised(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// The number of step lines (all but `####`) in an answer.
    fn step_lines(problem: &Problem) -> usize {
        problem.answer.lines().count() - 1
    }

    /// Parses a step line's `a op b = c`, the only `=` in it.
    fn equation(line: &str) -> (u64, char, u64, u64) {
        let (lhs, rhs) = line.split_once(" = ").expect("a step line has ` = `");
        let words: Vec<&str> = lhs.split(' ').collect();
        let n = words.len();
        let a: u64 = words[n - 3].parse().expect("left operand");
        let op = words[n - 2].chars().next().expect("operator");
        let b: u64 = words[n - 1].parse().expect("right operand");
        let c: u64 = rhs
            .split(' ')
            .next()
            .and_then(|c| c.parse().ok())
            .expect("result");
        (a, op, b, c)
    }

    #[test]
    fn deterministic_from_seed_split_and_index() {
        for index in 0..50 {
            assert_eq!(
                ArithTask::train(3).problem(index),
                ArithTask::train(3).problem(index)
            );
            assert_eq!(
                ArithTask::eval(3).problem(index),
                ArithTask::eval(3).problem(index)
            );
        }
        let a: Vec<Problem> = ArithTask::train(3).problems(0..20).collect();
        let b: Vec<Problem> = ArithTask::train(4).problems(0..20).collect();
        assert_ne!(a, b, "another seed gives other problems");
        let distinct: HashSet<&str> = a.iter().map(|p| p.question.as_str()).collect();
        assert!(distinct.len() >= 18, "indices give different problems");
    }

    #[test]
    fn deterministic_pinned_problems_never_change() {
        // Integer-only generation: this text changes only by a deliberate decision (which
        // invalidates recorded runs and evaluations).
        assert_eq!(
            ArithTask::train(0).problem(2),
            Problem {
                question: "A jar holds 44 buttons. Liam puts 5 more buttons in the jar. \
                           How many buttons are in the jar at the end?"
                    .into(),
                answer: "Liam puts 5 more buttons in the jar, so the jar now holds 44 + 5 = 49 \
                         buttons.\n#### 49"
                    .into(),
            }
        );
        assert_eq!(
            ArithTask::train(0).problem(1).answer,
            "Liam buys 4 bags of stickers with 2 stickers in each bag, so he buys 4 * 2 = 8 \
             stickers.\n#### 8"
        );
    }

    #[test]
    fn exact_every_step_is_correct_integer_arithmetic_within_bounds() {
        let tasks = [
            ArithTask::train(11),
            ArithTask::eval(11),
            ArithTask::train(11).with_max_value(MIN_MAX_VALUE),
            ArithTask::eval(11).with_max_value(100),
        ];
        for task in tasks {
            let mut largest = 0;
            for p in task.problems(0..2_000) {
                let mut previous = None;
                let lines: Vec<&str> = p.answer.lines().collect();
                for line in &lines[..lines.len() - 1] {
                    let (a, op, b, c) = equation(line);
                    let max = if line.ends_with("years old.") {
                        MAX_AGE.min(task.max_value())
                    } else {
                        task.max_value()
                    };
                    largest = largest.max(a.max(b).max(c));
                    let expected = match op {
                        '+' => a + b,
                        '-' => a.checked_sub(b).expect("no negative results"),
                        '*' => a * b,
                        '/' => {
                            assert_eq!(a % b, 0, "division is exact: {line}");
                            a / b
                        }
                        other => panic!("unknown operator {other} in {line}"),
                    };
                    assert_eq!(c, expected, "{line}");
                    assert!([a, b, c].iter().all(|n| (2..=max).contains(n)), "{line}");
                    // Products open with two fresh factors; every later step starts from the
                    // last result.
                    if let Some(previous) = previous {
                        assert_eq!(a, previous, "a step starts from the last result: {line}");
                    }
                    previous = Some(c);
                }
                let last = previous.expect("at least one step").to_string();
                assert_eq!(p.final_answer(), Some(last.as_str()), "{}", p.answer);
                assert!(p.question.ends_with('?'));
            }
            // The bound is reached, not just respected (it is not a no-op).
            assert!(
                largest * 2 > task.max_value(),
                "{largest} of {}",
                task.max_value()
            );
        }
    }

    #[test]
    fn bounded_max_value_is_clamped_and_the_default_is_unchanged() {
        assert_eq!(
            ArithTask::train(3).with_max_value(0).max_value(),
            MIN_MAX_VALUE
        );
        assert_eq!(
            ArithTask::train(3).with_max_value(u64::MAX).max_value(),
            MAX_VALUE
        );
        let easy = ArithTask::train(3).with_max_value(MIN_MAX_VALUE);
        for index in 0..200 {
            assert_eq!(
                ArithTask::train(3).with_max_value(MAX_VALUE).problem(index),
                ArithTask::train(3).problem(index)
            );
            // Opening products have factors within sqrt(20): 2..=4.
            let p = easy.problem(index);
            if let Some(rest) = p.question.split(" bags of ").next() {
                if let Some(x) = rest.rsplit(' ').next().and_then(|x| x.parse::<u64>().ok()) {
                    assert!((2..=4).contains(&x), "{}", p.question);
                }
            }
        }
    }

    #[test]
    fn long_tailed_steps_mostly_short_with_a_tail_to_twelve() {
        let counts = ArithTask::train(5).problems(0..10_000).fold(
            [0usize; MAX_STEPS + 1],
            |mut counts, p| {
                counts[step_lines(&p)] += 1;
                counts
            },
        );
        assert_eq!(counts[0], 0, "every problem has a step");
        let share = |range: Range<usize>| counts[range].iter().sum::<usize>() as f64 / 10_000.0;
        assert!((0.42..0.56).contains(&share(1..2)), "{counts:?}");
        assert!((0.68..0.82).contains(&share(1..4)), "{counts:?}");
        assert!((0.07..0.15).contains(&share(7..13)), "{counts:?}");
        assert!(
            counts[MAX_STEPS] > 0,
            "the tail reaches {MAX_STEPS}: {counts:?}"
        );
    }

    #[test]
    fn held_out_train_and_eval_share_no_question() {
        let train: HashSet<String> = ArithTask::train(9)
            .problems(0..4_000)
            .map(|p| p.question)
            .collect();
        let eval: Vec<Problem> = ArithTask::eval(9).problems(0..1_000).collect();
        assert!(eval.iter().all(|p| !train.contains(&p.question)));
        assert!(eval.iter().all(|p| split_of(&p.question) == Split::Eval));
        assert_eq!(ArithTask::eval(9).split(), Split::Eval);
    }

    #[test]
    fn restated_each_step_line_starts_with_its_question_sentence_in_order() {
        for task in [ArithTask::train(5), ArithTask::eval(5).with_max_value(20)] {
            for p in task.problems(0..1_000) {
                let lines: Vec<&str> = p.answer.lines().collect();
                let mut after = 0;
                for line in &lines[..lines.len() - 1] {
                    let (sentence, computation) = line
                        .split_once(", so ")
                        .unwrap_or_else(|| panic!("no restatement in {line:?}"));
                    let found = p.question[after..]
                        .find(&format!("{sentence}."))
                        .unwrap_or_else(|| panic!("{sentence:?} is not next in {:?}", p.question));
                    after += found + sentence.len();
                    assert!(computation.contains(" = "), "{line:?}");
                }
            }
        }
    }

    #[test]
    fn every_theme_and_operation_appears() {
        let text: String = ArithTask::train(1)
            .problems(0..500)
            .map(|p| p.question + &p.answer)
            .collect();
        for needle in [
            "bags of",
            "jar",
            "piggy bank",
            "machine",
            "years old",
            " + ",
            " - ",
            " * ",
            " / ",
        ] {
            assert!(text.contains(needle), "{needle} never appears");
        }
    }
}
