//! Models with Hugging Face tensor names, built from [`crate::nn::Module`]s.

pub mod bert;
mod bounds;
mod generate;
pub mod gpt2;
pub mod llama;
mod shape;

pub use bert::{BertConfig, BertForSequenceClassification, BertInput, BertLayer, BertModel};
pub use generate::{GenerationConfig, generate};
pub use gpt2::{Gpt2Config, Gpt2LmHeadModel};
pub use llama::{LlamaConfig, LlamaFamily, LlamaForCausalLM};
pub use shape::{TransformerShape, sequence_lengths};

/// The value additive attention masks put where attention is blocked: `dtype`'s lowest finite
/// value (as transformers' `torch.finfo(dtype).min`), so a blocked score stays finite and
/// `0 * lowest` is 0 (f32's lowest would be -inf in bf16 and fp16, and `0 * -inf` NaN).
pub(crate) fn mask_lowest(dtype: candle_core::DType) -> f64 {
    match dtype {
        candle_core::DType::F64 => f64::MIN,
        candle_core::DType::BF16 => half::bf16::MIN.to_f64(),
        candle_core::DType::F16 => half::f16::MIN.to_f64(),
        _ => f32::MIN as f64,
    }
}

/// The causal-LM loss of transformers (`ForCausalLMLoss`): position t predicts token t+1
/// (the last position predicts nothing), labels equal to -100 ignored, the mean over the
/// rest.
pub(crate) fn causal_lm_loss(
    logits: &candle_core::Tensor,
    labels: &candle_core::Tensor,
    reduction: crate::nn::ops::Reduction,
) -> candle_core::Result<candle_core::Tensor> {
    let (shifted, targets) = shift_for_next_token(logits, labels)?;
    let settings = crate::nn::ops::CrossEntropy {
        reduction,
        ..Default::default()
    };
    crate::nn::ops::cross_entropy(&shifted, &targets, settings)
}

/// The label tokens a causal-LM loss counts in `labels` [batch, seq]: positions 1.. (what
/// positions 0..seq-1 predict) not equal to -100 — transformers' `num_items_in_batch` for one
/// micro-batch. Summed over a step's micro-batches and ranks
/// ([`crate::accelerator::Accelerator::num_items_in_batch`]) it is what
/// [`crate::accelerator::Accelerator::backward_sum`] divides a summed loss by.
pub fn causal_lm_label_count(labels: &candle_core::Tensor) -> candle_core::Result<u64> {
    let (_, seq) = labels.dims2()?;
    if seq < 2 {
        return Ok(0);
    }
    let targets: Vec<i64> = labels
        .to_dtype(candle_core::DType::I64)?
        .narrow(1, 1, seq - 1)?
        .flatten_all()?
        .to_vec1()?;
    Ok(targets.iter().filter(|&&t| t != -100).count() as u64)
}

/// Positions 0..seq-1 of `x` [batch, seq, d] as rows [batch·(seq-1), d], and the labels
/// they predict (positions 1..seq, as i64): the pairing both causal-LM losses use.
fn shift_for_next_token(
    x: &candle_core::Tensor,
    labels: &candle_core::Tensor,
) -> candle_core::Result<(candle_core::Tensor, candle_core::Tensor)> {
    let (batch, seq, d) = x.dims3()?;
    let rows = x.narrow(1, 0, seq - 1)?.reshape((batch * (seq - 1), d))?;
    let targets = labels
        .to_dtype(candle_core::DType::I64)?
        .narrow(1, 1, seq - 1)?
        .flatten_all()?;
    Ok((rows, targets))
}

/// [`causal_lm_loss`] of the logits `hidden · weightᵀ` (`hidden` [batch, seq, h], `weight`
/// [vocab, h]) without making them: the shifted hidden states go through
/// [`crate::nn::ops::linear_cross_entropy`]. The loss is reported as module `head`'s output
/// (what the logits were), so a head wrapped as an FSDP unit still sees its forward end.
pub(crate) fn fused_causal_lm_loss(
    p: &dyn crate::nn::Params,
    hidden: &candle_core::Tensor,
    weight: &candle_core::Tensor,
    labels: &candle_core::Tensor,
    head: &str,
    reduction: crate::nn::ops::Reduction,
) -> candle_core::Result<candle_core::Tensor> {
    let (shifted, targets) = shift_for_next_token(hidden, labels)?;
    let settings = crate::nn::ops::CrossEntropy {
        reduction,
        ..Default::default()
    };
    let loss = crate::nn::ops::linear_cross_entropy(&shifted, weight, &targets, settings)?;
    crate::nn::ModuleOutput::report(loss, p, head)
}

/// Greedy decoding (transformers' `generate(do_sample=False)`) for any causal LM: up to
/// `max_new_tokens` tokens after `prompt`, each the most likely next one (the lowest id on a
/// tie, as `argmax`), stopping after `eos`. `logits` runs the model on ids `[1, len]` and
/// returns `[1, len, vocab]` (under FSDP, one `evaluate` per call, on every rank). Each step
/// runs the whole sequence again (no key/value cache): meant for short samples during
/// training, not for serving.
pub fn generate_greedy(
    prompt: &[u32],
    max_new_tokens: usize,
    eos: Option<u32>,
    mut logits: impl FnMut(&candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
) -> candle_core::Result<Vec<u32>> {
    let mut ids = prompt.to_vec();
    let mut new = Vec::new();
    for _ in 0..max_new_tokens {
        let input =
            candle_core::Tensor::from_slice(&ids, (1, ids.len()), &candle_core::Device::Cpu)?;
        let last: Vec<f32> = logits(&input)?
            .get(0)?
            .get(ids.len() - 1)?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()?;
        let next = last
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 { (i, v) } else { best }
            })
            .0 as u32;
        ids.push(next);
        new.push(next);
        if Some(next) == eos {
            break;
        }
    }
    Ok(new)
}
