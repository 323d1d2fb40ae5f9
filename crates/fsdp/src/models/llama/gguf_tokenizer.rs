//! The tokenizer of a GGUF file rebuilt from its metadata as a Hugging Face `tokenizers`
//! byte-level BPE (`tokenizer.ggml.model: gpt2`, what SmolLM2, Llama 3 and Qwen2 files hold):
//! the vocabulary and merges as stored, the pre-tokenizer llama.cpp names in
//! `tokenizer.ggml.pre` (SmolLM2's `smollm`: single digits split off, then GPT-2's byte-level
//! split, as its `tokenizer.json` does), control tokens kept whole as special tokens, and the
//! BOS token prepended when the file says so.

use candle_core::Result;
use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::GgufFile;

/// Llama 3's split (`llama-bpe`), as in its `tokenizer.json`.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split, as in its `tokenizer.json`.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's token type of control tokens (`<|im_start|>`).
const CONTROL: u32 = 3;
/// llama.cpp's token type of user-defined added tokens.
const USER_DEFINED: u32 = 4;

fn err(gguf: &GgufFile, msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: tokenizer: {msg}", gguf.path().display()))
}

fn strings(gguf: &GgufFile, key: &str) -> Result<Vec<String>> {
    let values = gguf
        .required(key)?
        .to_vec()
        .map_err(|e| err(gguf, format!("`{key}`: {e}")))?;
    values
        .iter()
        .map(|v| {
            v.to_string()
                .cloned()
                .map_err(|e| err(gguf, format!("`{key}`: {e}")))
        })
        .collect()
}

fn flag(gguf: &GgufFile, key: &str) -> bool {
    gguf.metadata(key)
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false)
}

/// The split before the byte-level mapping for llama.cpp's pre-tokenizer name.
fn pre_tokenizer(gguf: &GgufFile, pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level = |regex: bool| ByteLevel::new(false, true, regex);
    let split = |regex: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(regex.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| err(gguf, e))?;
        Ok(Sequence::new(vec![split.into(), byte_level(false).into()]).into())
    };
    match pre {
        "gpt2" | "default" => Ok(byte_level(true).into()),
        "smollm" => {
            Ok(Sequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into())
        }
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" => split(LLAMA3_SPLIT),
        "qwen2" => split(QWEN2_SPLIT),
        other => Err(err(
            gguf,
            format!(
                "`tokenizer.ggml.pre` {other:?} is not implemented (gpt2, smollm, llama-bpe, qwen2)"
            ),
        )),
    }
}

/// The file's tokenizer (see the module docs); an error names the metadata key it cannot
/// follow.
pub fn gguf_tokenizer(gguf: &GgufFile) -> Result<Tokenizer> {
    let model = gguf
        .required("tokenizer.ggml.model")?
        .to_string()
        .map_err(|e| err(gguf, e))?;
    if model != "gpt2" {
        return Err(err(
            gguf,
            format!("`tokenizer.ggml.model` {model:?} is not implemented (gpt2: byte-level BPE)"),
        ));
    }
    let tokens = strings(gguf, "tokenizer.ggml.tokens")?;
    let merges = strings(gguf, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok((a.to_string(), b.to_string())),
            None => Err(err(
                gguf,
                format!("`tokenizer.ggml.merges` entry {m:?} is not a pair"),
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| err(gguf, e))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let pre = match gguf.metadata("tokenizer.ggml.pre").map(Value::to_string) {
        Some(Ok(p)) => p.clone(),
        _ => "gpt2".to_string(),
    };
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(gguf, &pre)?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));
    let types: Vec<u32> = match gguf
        .metadata("tokenizer.ggml.token_type")
        .map(Value::to_vec)
    {
        Some(Ok(v)) => v
            .iter()
            .map(|t| {
                t.to_i32()
                    .map(|x| x as u32)
                    .or_else(|_| t.to_u32())
                    .unwrap_or(1)
            })
            .collect(),
        _ => Vec::new(),
    };
    let added = |kind: u32, special: bool| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == kind)
            .map(|(tok, _)| AddedToken::from(tok.clone(), special).normalized(false))
            .collect()
    };
    tokenizer
        .add_special_tokens(added(CONTROL, true))
        .map_err(|e| err(gguf, format!("control tokens: {e}")))?;
    tokenizer
        .add_tokens(added(USER_DEFINED, false))
        .map_err(|e| err(gguf, format!("user-defined tokens: {e}")))?;
    if flag(gguf, "tokenizer.ggml.add_bos_token")
        && let Some(bos) = gguf.number("tokenizer.ggml.bos_token_id").map(|x| x as u32)
    {
        let name = tokens.get(bos as usize).ok_or_else(|| {
            err(
                gguf,
                format!("bos token id {bos} is outside the vocabulary"),
            )
        })?;
        let template = TemplateProcessing::builder()
            .try_single(format!("{name} $A"))
            .and_then(|b| {
                b.special_tokens(vec![(name.clone(), bos)])
                    .build()
                    .map_err(|e| e.to_string())
            })
            .map_err(|e| err(gguf, e))?;
        tokenizer.with_post_processor(Some(template));
    }
    Ok(tokenizer)
}
