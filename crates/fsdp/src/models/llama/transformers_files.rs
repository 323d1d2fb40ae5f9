//! The files transformers reads beside a Llama-family model's weights, written so that
//! transformers 4.4x and 5.x read them the same: `config.json` with the RoPE settings both
//! ways (5.x reads `rope_parameters`; 4.x only the top-level `rope_theta` and `rope_scaling`,
//! and silently takes 10000 for a missing `rope_theta`), `tokenizer_config.json` and
//! `special_tokens_map.json` naming the special tokens (without them 4.x's `AutoTokenizer`
//! builds a `LlamaTokenizerFast` that adds a `<s>` past the vocabulary), and
//! `generation_config.json` with the ids `generate` stops and pads with.

use std::path::Path;

use candle_core::Result;
use candle_core::quantized::gguf_file::Value as GgufValue;
use serde_json::{Map, Value, json};
use tokenizers::Tokenizer;

use super::GgufFile;

/// What a tokenizer's files say beyond `tokenizer.json` and the ids in `config.json`: the
/// unknown token and the chat template (a GGUF file's `tokenizer.ggml.unknown_token_id` and
/// `tokenizer.chat_template`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerExtras {
    /// The unknown token's id, where the tokenizer has one.
    pub unk_token_id: Option<u32>,
    /// The Jinja chat template, where the model has one.
    pub chat_template: Option<String>,
}

impl TokenizerExtras {
    /// The extras a GGUF file's metadata holds (absent keys are `None`).
    pub fn from_gguf(gguf: &GgufFile) -> Self {
        TokenizerExtras {
            unk_token_id: gguf
                .number("tokenizer.ggml.unknown_token_id")
                .map(|x| x as u32),
            chat_template: gguf
                .metadata("tokenizer.chat_template")
                .and_then(|v| GgufValue::to_string(v).ok())
                .cloned(),
        }
    }

    /// The extras a transformers `tokenizer_config.json` at `path` holds (`unk_token` as
    /// `tokenizer` spells it, `chat_template`); a missing file has none. A file that is not
    /// JSON is an error naming it.
    pub fn from_tokenizer_config(path: &Path, tokenizer: &Tokenizer) -> Result<Self> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => {
                return Err(candle_core::Error::Msg(format!(
                    "reading {}: {e}",
                    path.display()
                )));
            }
        };
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| candle_core::Error::Msg(format!("{}: not JSON: {e}", path.display())))?;
        // A special token is a string, or an object with its `content` (older files).
        let unk = v["unk_token"]
            .as_str()
            .or_else(|| v["unk_token"]["content"].as_str());
        Ok(TokenizerExtras {
            unk_token_id: unk.and_then(|t| tokenizer.token_to_id(t)),
            chat_template: v["chat_template"].as_str().map(str::to_string),
        })
    }
}

/// `config` with its RoPE settings written both ways: `rope_parameters` (transformers 5) from
/// `rope_theta` and `rope_scaling`, or `rope_theta` and (for a scaled RoPE) `rope_scaling`
/// (transformers 4) from `rope_parameters`. A config with neither gets transformers' default
/// base, 10000, stated in both places.
pub fn portable_config(config: &Value) -> Value {
    let mut out = config.clone();
    let Some(map) = out.as_object_mut() else {
        return out;
    };
    let parameters = match map.get("rope_parameters").and_then(Value::as_object) {
        Some(p) => p.clone(),
        None => {
            let mut p = match map.get("rope_scaling").and_then(Value::as_object) {
                Some(s) => s.clone(),
                None => Map::from_iter([("rope_type".to_string(), json!("default"))]),
            };
            let theta = map.get("rope_theta").cloned().unwrap_or(json!(10000.0));
            p.insert("rope_theta".into(), theta);
            p
        }
    };
    let theta = parameters
        .get("rope_theta")
        .cloned()
        .unwrap_or(json!(10000.0));
    let scaled = parameters
        .get("rope_type")
        .or_else(|| parameters.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|t| t != "default");
    if scaled {
        let mut scaling = parameters.clone();
        scaling.remove("rope_theta");
        map.insert("rope_scaling".into(), Value::Object(scaling));
    } else {
        map.remove("rope_scaling");
    }
    map.insert("rope_theta".into(), theta);
    map.insert("rope_parameters".into(), Value::Object(parameters));
    out
}

/// The first id of a `config.json` field holding one id or a list of them
/// (`eos_token_id: [2, 3]`), as transformers reads the special tokens' ids.
pub fn config_token_id(config: &Value, key: &str) -> Option<u32> {
    let v = &config[key];
    v.as_u64()
        .or_else(|| v.as_array()?.first()?.as_u64())
        .and_then(|id| u32::try_from(id).ok())
}

/// `tokenizer_config.json` and `special_tokens_map.json` for `tokenizer` (saved as
/// `tokenizer.json` beside them): the fast tokenizer read as it is
/// (`PreTrainedTokenizerFast`, which adds only what `tokenizer.json`'s post-processor adds),
/// and the special tokens `config` names by id. An id outside the vocabulary is an error
/// naming the field.
pub fn tokenizer_files(
    config: &Value,
    tokenizer: &Tokenizer,
    extras: &TokenizerExtras,
) -> Result<(Value, Value)> {
    let token = |key: &str, id: Option<u32>| -> Result<Option<String>> {
        id.map(|id| {
            tokenizer.id_to_token(id).ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "`{key}` {id} is outside the tokenizer's vocabulary of {}",
                    tokenizer.get_vocab_size(true)
                ))
            })
        })
        .transpose()
    };
    let mut special = Map::new();
    for (name, key, id) in [
        (
            "bos_token",
            "bos_token_id",
            config_token_id(config, "bos_token_id"),
        ),
        (
            "eos_token",
            "eos_token_id",
            config_token_id(config, "eos_token_id"),
        ),
        (
            "pad_token",
            "pad_token_id",
            config_token_id(config, "pad_token_id"),
        ),
        ("unk_token", "unk_token_id", extras.unk_token_id),
    ] {
        if let Some(t) = token(key, id)? {
            special.insert(name.into(), json!(t));
        }
    }
    let mut tokenizer_config = special.clone();
    tokenizer_config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    tokenizer_config.insert("clean_up_tokenization_spaces".into(), json!(false));
    // A causal LM takes no token types (4.x's generic fast tokenizer returns them unless told,
    // and `generate` refuses them).
    tokenizer_config.insert(
        "model_input_names".into(),
        json!(["input_ids", "attention_mask"]),
    );
    if let Some(n) = config["max_position_embeddings"].as_u64() {
        tokenizer_config.insert("model_max_length".into(), json!(n));
    }
    if let Some(t) = &extras.chat_template {
        tokenizer_config.insert("chat_template".into(), json!(t));
    }
    Ok((Value::Object(tokenizer_config), Value::Object(special)))
}

/// `generation_config.json`: the ids `generate` starts, stops and pads with, from `config`.
pub fn generation_config(config: &Value) -> Value {
    let mut out = Map::new();
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if !config[key].is_null() {
            out.insert(key.into(), config[key].clone());
        }
    }
    Value::Object(out)
}

/// Writes `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` and
/// `generation_config.json` into `dir` (beside a `save_pretrained`'s weights and its
/// [`portable_config`]), each through a temporary file renamed into place, so a reader never
/// sees half a file. Errors name the file.
pub fn write_tokenizer_and_generation_files(
    dir: &Path,
    config: &Value,
    tokenizer: &Tokenizer,
    extras: &TokenizerExtras,
) -> Result<()> {
    let (tokenizer_config, special) = tokenizer_files(config, tokenizer, extras)?;
    let tokenizer_json = tokenizer
        .to_string(false)
        .map_err(|e| candle_core::Error::Msg(format!("serialising the tokenizer: {e}")))?;
    for (name, text) in [
        ("tokenizer.json", tokenizer_json),
        ("tokenizer_config.json", format!("{tokenizer_config:#}")),
        ("special_tokens_map.json", format!("{special:#}")),
        (
            "generation_config.json",
            format!("{:#}", generation_config(config)),
        ),
    ] {
        let path = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| candle_core::Error::Msg(format!("writing {}: {e}", path.display())))?;
    }
    Ok(())
}
