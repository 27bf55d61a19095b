//! A conversation in a tokenizer's chat format: a training sample whose loss covers the
//! assistant's turns only ([`Sample::from_chat`]), or the prompt a model answers
//! ([`prompt_from_chat`]). The template is the tokenizer's ([`super::ChatTemplate`]).
//!
//! Guarantees (tested with the templates, in `chat.rs`):
//!
//! 1. **Loss on the assistant's turns, end-of-turn included**: [`Sample::from_chat`] renders the
//!    whole conversation and encodes it once (special tokens written by the template, such as
//!    `<|im_start|>`, become their single ids; no BOS is added beyond the one the template writes).
//!    Assistant turn `i` spans from the end of `render(messages[..i], add_generation_prompt)` to
//!    the end of its end-of-turn token: the last stop token (EOS, `<|im_end|>`, `<|eot_id|>`, …)
//!    in `render(messages[..=i])` past that point, or that render's end if it has none. A token
//!    carries loss exactly when its bytes lie inside such a span: the assistant's content and its
//!    end-of-turn token, never the `<|im_start|>assistant\n` header nor the newline after
//!    `<|im_end|>`. A template whose renders of a conversation's beginnings are not beginnings of
//!    its whole render (one that rewrites earlier turns) cannot be masked this way and is an
//!    error naming it.
//! 2. **Prompts for generation**: [`prompt_from_chat`] is the conversation rendered with
//!    `add_generation_prompt`, encoded the same way: the ids a model continues with an answer.

use super::chat::Message;
use super::hf_tokenizer::HfTokenizer;
use super::packing::Sample;
use super::TextError;

impl Sample {
    /// The conversation `messages` in `tokenizer`'s chat format, with loss on the assistant's
    /// turns and their end-of-turn tokens only (guarantee 1). An error names the tokenizer when
    /// it has no chat template, or the template when it fails or rewrites earlier turns.
    pub fn from_chat(tokenizer: &HfTokenizer, messages: &[Message]) -> Result<Self, TextError> {
        let template = tokenizer.require_chat_template()?;
        let text = template.render(messages, false)?;
        let spans = template.assistant_spans(messages, &text, &tokenizer.stop_texts())?;
        let encoding = tokenizer.encode_text(&text)?;
        let loss_mask = encoding
            .get_offsets()
            .iter()
            .map(|&(start, end)| {
                spans
                    .iter()
                    .any(|span| span.start <= start && end <= span.end && start < span.end)
            })
            .collect();
        Sample::new(encoding.get_ids().to_vec(), loss_mask)
    }
}

/// The ids a model continues to answer `messages`: their render with the generation prompt
/// (guarantee 2). An error names the tokenizer or the template.
pub fn prompt_from_chat(
    tokenizer: &HfTokenizer,
    messages: &[Message],
) -> Result<Vec<u32>, TextError> {
    let text = tokenizer.require_chat_template()?.render(messages, true)?;
    Ok(tokenizer.encode_text(&text)?.get_ids().to_vec())
}
