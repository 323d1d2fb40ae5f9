//! Llama-family models from a llama.cpp GGUF file: the config rebuilt from the file's
//! metadata ([`gguf_config`], the transformers `config.json` it stands for), and
//! [`GgufWeights`], a [`WeightSource`] that dequantizes one tensor at a time to f32 (candle's
//! `quantized` reader and kernels), maps llama.cpp's tensor names to transformers' and undoes
//! the row permutation llama.cpp's converter applies to the query and key projections of the
//! `llama` architecture. Errors name the file and the tensor.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Result};
use serde_json::json;

use super::LlamaConfig;
use crate::nn::WeightSource;
use crate::nn::module::ParamSpec;
use crate::nn::quant::QuantFormat;

/// A GGUF file opened for its metadata and tensor directory (no tensor data read yet).
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    file: Mutex<File>,
}

fn err(path: &Path, msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {msg}", path.display()))
}

impl GgufFile {
    /// Opens `path` and reads its header (metadata and tensor directory).
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| err(path, format!("opening: {e}")))?;
        // The header is read a field at a time (a string's length, then its bytes): through
        // a buffer, a tokenizer's vocabulary is not a quarter of a million system calls.
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let content = Content::read(&mut reader)
            .map_err(|e| err(path, format!("not a readable GGUF file: {e}")))?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            content,
            file: Mutex::new(reader.into_inner()),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value.
    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// A numeric metadata value (of any of GGUF's integer or float types) as f64.
    pub fn number(&self, key: &str) -> Option<f64> {
        self.metadata(key).and_then(number)
    }

    /// A metadata value that must be there.
    pub(crate) fn required(&self, key: &str) -> Result<&Value> {
        self.metadata(key)
            .ok_or_else(|| err(&self.path, format!("metadata `{key}` is missing")))
    }

    /// The tensor names in the file.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.content.tensor_infos.keys().map(String::as_str)
    }

    /// `name`'s values dequantized to f32, with its shape (row-major, transformers' order).
    fn dequantized(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let bad = |e: candle_core::Error| err(&self.path, format!("tensor `{name}`: {e}"));
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let q = self
            .content
            .tensor(&mut *file, name, &Device::Cpu)
            .map_err(bad)?;
        let t = q.dequantize(&Device::Cpu).map_err(bad)?;
        let shape = t.dims().to_vec();
        Ok((
            t.flatten_all().and_then(|t| t.to_vec1()).map_err(bad)?,
            shape,
        ))
    }

    /// `name`'s stored block type, its blocks' bytes (row after row) and its shape.
    fn blocks(&self, name: &str) -> Result<(GgmlDType, Vec<u8>, Vec<usize>)> {
        let bad = |e: candle_core::Error| err(&self.path, format!("tensor `{name}`: {e}"));
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let q = self
            .content
            .tensor(&mut *file, name, &Device::Cpu)
            .map_err(bad)?;
        let bytes = q.data().map_err(bad)?.into_owned();
        Ok((q.dtype(), bytes, q.shape().dims().to_vec()))
    }
}

fn number(v: &Value) -> Option<f64> {
    v.to_f64()
        .ok()
        .or_else(|| v.to_f32().ok().map(f64::from))
        .or_else(|| v.to_u64().ok().map(|x| x as f64))
        .or_else(|| v.to_u32().ok().map(f64::from))
        .or_else(|| v.to_i32().ok().map(f64::from))
        .or_else(|| v.to_i64().ok().map(|x| x as f64))
}

/// The transformers `config.json` a GGUF file's metadata stands for (as transformers rebuilds
/// it), and the config read from it. Architectures `llama` (SmolLM2, Llama, and Mistral as
/// llama.cpp writes it) and `qwen2`; a rope scaling type in the metadata is refused, naming
/// the key.
pub fn gguf_config(gguf: &GgufFile) -> Result<(serde_json::Value, LlamaConfig)> {
    let path = gguf.path();
    let arch = gguf
        .required("general.architecture")?
        .to_string()
        .map_err(|e| err(path, e))?
        .clone();
    let model_type = match arch.as_str() {
        "llama" => "llama",
        "qwen2" => "qwen2",
        other => {
            return Err(err(
                path,
                format!(
                    "`general.architecture` {other:?} is not one this implementation reads (llama, qwen2)"
                ),
            ));
        }
    };
    let num = |key: &str| -> Result<f64> {
        let full = format!("{arch}.{key}");
        number(gguf.required(&full)?)
            .ok_or_else(|| err(path, format!("metadata `{full}` is not a number")))
    };
    // A count or size: a whole number (GGUF stores them as integers; a float that is not
    // whole, or a negative one, is a damaged or crafted file, not something to truncate).
    let whole = |full: &str, x: f64| -> Result<u64> {
        if x.fract() == 0.0 && (0.0..=u64::MAX as f64).contains(&x) {
            Ok(x as u64)
        } else {
            Err(err(
                path,
                format!("metadata `{full}` is {x}, not a whole number"),
            ))
        }
    };
    let count = |key: &str| -> Result<u64> { whole(&format!("{arch}.{key}"), num(key)?) };
    let id = |key: &str| gguf.number(key).map(|x| whole(key, x)).transpose();
    for key in ["rope.scaling.type", "rope.scaling.factor", "expert_count"] {
        let full = format!("{arch}.{key}");
        if let Some(v) = gguf.metadata(&full) {
            let none = matches!(v.to_string().map(String::as_str), Ok("none"));
            if !none {
                return Err(err(
                    path,
                    format!("metadata `{full}` is set: not implemented for GGUF files"),
                ));
            }
        }
    }
    if gguf.tensor_names().any(|n| n == "rope_freqs.weight") {
        return Err(err(
            path,
            "tensor `rope_freqs.weight` (llama.cpp's stored rope frequencies) is not implemented",
        ));
    }
    let heads = count("attention.head_count")?;
    let hidden = count("embedding_length")?;
    let vocab = match gguf.metadata("tokenizer.ggml.tokens").map(Value::to_vec) {
        Some(Ok(tokens)) => tokens.len() as f64,
        _ => count("vocab_size")? as f64,
    };
    let head_dim = match gguf.metadata(&format!("{arch}.rope.dimension_count")) {
        Some(_) => Some(count("rope.dimension_count")?),
        None => Some(hidden / heads.max(1)),
    };
    let kv_heads = match gguf.metadata(&format!("{arch}.attention.head_count_kv")) {
        Some(_) => count("attention.head_count_kv")?,
        None => heads,
    };
    let config = json!({
        "model_type": model_type,
        "vocab_size": vocab as u64,
        "hidden_size": hidden,
        "intermediate_size": count("feed_forward_length")?,
        "num_hidden_layers": count("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": count("context_length")?,
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon")?,
        "rope_parameters": {"rope_type": "default", "rope_theta": num("rope.freq_base").unwrap_or(10000.0)},
        "tie_word_embeddings": !gguf.tensor_names().any(|n| n == "output.weight"),
        "hidden_act": "silu",
        "bos_token_id": id("tokenizer.ggml.bos_token_id")?,
        "eos_token_id": id("tokenizer.ggml.eos_token_id")?,
        "pad_token_id": id("tokenizer.ggml.padding_token_id")?,
        "architectures": [if model_type == "qwen2" { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
    });
    let parsed = LlamaConfig::from_value(&config).map_err(|e| err(path, e))?;
    Ok((config, parsed))
}

/// transformers' name of a llama.cpp tensor, or `None` for a name this mapping does not know.
fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, leaf) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (module, kind) = leaf.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let ours = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{ours}.{kind}"))
}

/// Undoes llama.cpp's permutation of a query or key projection's rows (weight or bias): its
/// converter stores each head's rows as interleaved pairs `(i, i + d/2)`, where transformers
/// keeps the two halves apart (rotate-half). `heads` heads of `values.len() / row / heads`
/// rows each, `row` elements per row.
fn unpermute_rows(values: &[f32], heads: usize, row: usize) -> Vec<f32> {
    let d = values.len() / row / heads;
    let half = d / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for a in 0..2 {
            for i in 0..half {
                let (ours, theirs) = (h * d + a * half + i, h * d + 2 * i + a);
                out[ours * row..(ours + 1) * row]
                    .copy_from_slice(&values[theirs * row..(theirs + 1) * row]);
            }
        }
    }
    out
}

/// The weights of a GGUF file as transformers names them, dequantized to f32 when read.
pub struct GgufWeights {
    gguf: GgufFile,
    /// transformers' name → llama.cpp's.
    names: HashMap<String, String>,
    /// (query heads, K/V heads) when q and k rows are permuted (architecture `llama`).
    permuted: Option<(usize, usize)>,
}

impl GgufWeights {
    /// The weights of `gguf` for a model of `config`; a tensor whose name maps to nothing is an
    /// error naming it and the file.
    pub fn new(gguf: GgufFile, config: &LlamaConfig) -> Result<GgufWeights> {
        let mut names = HashMap::new();
        for name in gguf.tensor_names() {
            let ours = hf_name(name).ok_or_else(|| {
                err(
                    gguf.path(),
                    format!("tensor `{name}` maps to no parameter of a Llama-family model"),
                )
            })?;
            let layer = name
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|i| i.parse::<usize>().ok());
            if let Some(layer) = layer.filter(|&l| l >= config.num_hidden_layers) {
                return Err(err(
                    gguf.path(),
                    format!(
                        "tensor `{name}` is for layer {layer}, but the model has {} layers (`block_count`)",
                        config.num_hidden_layers
                    ),
                ));
            }
            names.insert(ours, name.to_string());
        }
        let llama = matches!(gguf.metadata("general.architecture").map(Value::to_string), Some(Ok(a)) if a == "llama");
        Ok(GgufWeights {
            permuted: llama.then_some((config.num_attention_heads, config.num_key_value_heads)),
            gguf,
            names,
        })
    }

    /// The file.
    pub fn file(&self) -> &GgufFile {
        &self.gguf
    }
}

impl GgufWeights {
    /// The file's name of parameter `spec`.
    fn theirs(&self, spec: &ParamSpec) -> Result<&str> {
        self.names
            .get(&spec.name)
            .map(String::as_str)
            .ok_or_else(|| {
                err(
                    self.gguf.path(),
                    format!("no tensor for parameter `{}`", spec.name),
                )
            })
    }

    /// The heads whose rows llama.cpp permuted in parameter `name` (q and k projections).
    fn permuted_heads(&self, name: &str) -> Option<usize> {
        match self.permuted {
            Some((q, _)) if name.contains(".self_attn.q_proj.") => Some(q),
            Some((_, kv)) if name.contains(".self_attn.k_proj.") => Some(kv),
            _ => None,
        }
    }
}

impl WeightSource for GgufWeights {
    /// A quantized parameter in the file's own block type is its blocks as stored (never
    /// dequantized); in another format, the dequantized weight quantized again.
    fn packed_rows(
        &self,
        spec: &ParamSpec,
        take: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let Some(packing) = spec.packing else {
            return self.read_rows(spec, take);
        };
        let theirs = self.theirs(spec)?;
        let (dtype, bytes, shape) = self.gguf.blocks(theirs)?;
        if packing.format != QuantFormat::Ggml(dtype) {
            let words = packing.quantize(&self.values(&spec.unpacked())?);
            return take(0, &words);
        }
        let want = spec.unpacked().shape;
        if shape != want {
            return Err(err(
                self.gguf.path(),
                format!(
                    "tensor `{theirs}` ({}) has shape {shape:?}, the config implies {want:?}",
                    spec.name
                ),
            ));
        }
        let words = packing
            .words_from_row_bytes(&bytes)
            .map_err(|e| err(self.gguf.path(), format!("tensor `{theirs}`: {e}")))?;
        match self.permuted_heads(&spec.name) {
            Some(heads) => take(0, &unpermute_rows(&words, heads, packing.row_words())),
            None => take(0, &words),
        }
    }

    fn values(&self, spec: &ParamSpec) -> Result<Vec<f32>> {
        let path = self.gguf.path();
        let theirs = self.theirs(spec)?;
        let (values, shape) = self.gguf.dequantized(theirs)?;
        if shape != spec.shape {
            return Err(err(
                path,
                format!(
                    "tensor `{theirs}` ({}) has shape {shape:?}, the config implies {:?}",
                    spec.name, spec.shape
                ),
            ));
        }
        let Some(heads) = self.permuted_heads(&spec.name) else {
            return Ok(values);
        };
        let row = shape.iter().skip(1).product::<usize>().max(1);
        Ok(unpermute_rows(&values, heads, row))
    }
}
