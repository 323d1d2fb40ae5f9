//! Where a model's initial weights come from, one parameter at a time ([`WeightSource`]): a map
//! of tensors already in memory, the seeded initialisation ([`SeededWeights`]), or
//! [`SafetensorsWeights`], a pretrained checkpoint whose
//! tensors are read from disk only when asked for. The FSDP engine shards from a source unit
//! by unit, so with `fsdp_cpu_ram_efficient_loading` only rank 0 reads the file and no rank
//! ever holds the whole model.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use candle_core::{Device, Result, Tensor};
use half::{bf16, f16};
use safetensors::Dtype;
use safetensors::tensor::Metadata;

use super::module::{LoadReport, ModuleInfo, ParamSpec, match_names};

/// A model's initial weights, read one parameter at a time.
pub trait WeightSource {
    /// Parameter `spec`'s values as f32, row-major, `spec.shape` (checked).
    fn values(&self, spec: &ParamSpec) -> Result<Vec<f32>>;

    /// Parameter `spec`'s values in consecutive pieces of whole rows (dim 0), each given to
    /// `take` with the index of its first row, so a reader need not hold the whole tensor.
    /// The default gives [`WeightSource::values`] in one piece.
    fn read_rows(
        &self,
        spec: &ParamSpec,
        take: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        take(0, &self.values(spec)?)
    }

    /// Quantized parameter `spec`'s words ([`ParamSpec::packing`]) in pieces of whole rows.
    /// The default quantizes the weight it stands for ([`ParamSpec::unpacked`]) a piece of
    /// rows at a time; a source that holds the blocks already (a GGUF file) gives them.
    fn packed_rows(
        &self,
        spec: &ParamSpec,
        take: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let Some(packing) = spec.packing else {
            return self.read_rows(spec, take);
        };
        self.read_rows(&spec.unpacked(), &mut |first, piece| {
            take(first, &packing.quantize(piece))
        })
    }

    /// The device training computes on for these weights.
    fn device(&self) -> Device {
        Device::Cpu
    }
}

/// Parameter `spec`'s elements from `source` in pieces of whole rows: a quantized
/// parameter's words ([`WeightSource::packed_rows`]), any other's values.
pub fn read_param_rows(
    source: &(impl WeightSource + ?Sized),
    spec: &ParamSpec,
    take: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    match spec.packing {
        Some(_) => source.packed_rows(spec, take),
        None => source.read_rows(spec, take),
    }
}

/// [`read_param_rows`] in one vector.
pub fn read_param(source: &(impl WeightSource + ?Sized), spec: &ParamSpec) -> Result<Vec<f32>> {
    if spec.packing.is_none() {
        return source.values(spec);
    }
    let mut all = Vec::new();
    source.packed_rows(spec, &mut |_, piece| {
        all.extend_from_slice(piece);
        Ok(())
    })?;
    Ok(all)
}

/// A model's seeded initialisation (what [`super::LocalParams::init`] gives, in f32), made
/// one parameter at a time when asked for: a model of any size starts training without its
/// weights ever being whole in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeededWeights(pub u64);

impl SeededWeights {
    fn fresh(&self, spec: &ParamSpec) -> Vec<f32> {
        spec.initial_f32(self.0)
    }
}

impl WeightSource for SeededWeights {
    fn values(&self, spec: &ParamSpec) -> Result<Vec<f32>> {
        Ok(self.fresh(spec))
    }
}

fn wrong_shape(what: &str, name: &str, got: &[usize], want: &[usize]) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{what}: `{name}` has shape {got:?}, the model expects {want:?}"
    ))
}

impl WeightSource for BTreeMap<String, Tensor> {
    fn values(&self, spec: &ParamSpec) -> Result<Vec<f32>> {
        let t = self.get(&spec.name).ok_or_else(|| {
            candle_core::Error::Msg(format!("no initial weight for `{}`", spec.name))
        })?;
        if t.dims() != spec.shape.as_slice() {
            return Err(wrong_shape(
                "initial weights",
                &spec.name,
                t.dims(),
                &spec.shape,
            ));
        }
        t.flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()
    }

    /// A quantized parameter's words when the map holds them (a quantized model's own
    /// tensors), else the weight it stands for, quantized.
    fn packed_rows(
        &self,
        spec: &ParamSpec,
        take: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let Some(packing) = spec.packing else {
            return self.read_rows(spec, take);
        };
        match self.get(&spec.name) {
            Some(t)
                if t.dims() == spec.shape.as_slice() && t.dtype() == candle_core::DType::F32 =>
            {
                take(0, &t.flatten_all()?.to_vec1()?)
            }
            _ => take(
                0,
                &packing.quantize(&WeightSource::values(self, &spec.unpacked())?),
            ),
        }
    }

    fn device(&self) -> Device {
        self.values()
            .next()
            .map_or(Device::Cpu, |t| t.device().clone())
    }
}

/// Where one tensor's bytes are.
#[derive(Debug, Clone)]
struct Located {
    file: usize,
    /// Its name in the file.
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range in the file (its length checked against dtype and shape).
    bytes: (u64, u64),
}

impl Located {
    /// Bytes per element.
    fn width(&self) -> usize {
        self.dtype.bitsize() / 8
    }
}

/// A pretrained checkpoint (`model.safetensors`, or the shards of a split one) read one
/// tensor at a time with positioned reads: opening reads the headers only, so a rank that
/// never asks for a tensor never reads the file, and the one that does holds one tensor at a
/// time (no mapping whose pages would stay resident). File names are matched to the model's
/// as [`super::load_by_name`] does; parameters the files lack (a fresh task head) get their
/// seeded initialisation.
pub struct SafetensorsWeights {
    files: Vec<(PathBuf, File)>,
    tensors: HashMap<String, Located>,
    seed: u64,
    report: LoadReport,
}

impl SafetensorsWeights {
    /// Opens `paths` for `model`; parameters not in them are initialised from `seed`.
    ///
    /// ```no_run
    /// use fsdp_nn::SafetensorsWeights;
    /// # fn main() -> fsdp_nn::candle::Result<()> {
    /// # let model = fsdp_nn::layers::Linear::new("classifier".into(), 4, 2, 0.02);
    /// use fsdp_nn::Module;
    /// // A pretrained file; tensors are read one parameter at a time when the engine asks.
    /// let weights = SafetensorsWeights::open(&["model/model.safetensors".into()], &model.info(), 42)?;
    /// let report = weights.report();
    /// println!("newly initialised: {:?}; not used: {:?}", report.missing, report.unexpected);
    /// # Ok(())
    /// # }
    /// ```
    pub fn open(paths: &[PathBuf], model: &ModuleInfo, seed: u64) -> Result<SafetensorsWeights> {
        let mut files = Vec::new();
        let mut found: HashMap<String, Located> = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(|e| io_error(path, "opening", e))?;
            for located in read_header(path, &file, i)? {
                found.insert(located.name.clone(), located);
            }
            files.push((path.clone(), file));
        }
        let (names, report) = match_names(model, found.keys().cloned().collect());
        let tensors = names
            .into_iter()
            .filter_map(|(ours, theirs)| found.remove(&theirs).map(|l| (ours, l)))
            .collect();
        Ok(SafetensorsWeights {
            files,
            tensors,
            seed,
            report,
        })
    }

    /// Opens a pretrained folder as transformers' `from_pretrained` finds its weights: the
    /// files `model.safetensors.index.json` lists (a split checkpoint; every tensor it maps
    /// must be in the file it names), else `model.safetensors`. Errors name the file.
    pub fn open_dir(dir: &Path, model: &ModuleInfo, seed: u64) -> Result<SafetensorsWeights> {
        let index = dir.join("model.safetensors.index.json");
        if !index.exists() {
            return SafetensorsWeights::open(&[dir.join("model.safetensors")], model, seed);
        }
        let bad = |why: String| candle_core::Error::Msg(format!("{}: {why}", index.display()));
        let text = std::fs::read_to_string(&index).map_err(|e| io_error(&index, "reading", e))?;
        let doc: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let map = doc["weight_map"]
            .as_object()
            .ok_or_else(|| bad("no `weight_map` object".into()))?;
        let mut files: Vec<String> = Vec::new();
        for (tensor, file) in map {
            let file = file
                .as_str()
                .filter(|f| !f.is_empty() && !f.contains('/') && !f.contains('\\') && *f != "..")
                .ok_or_else(|| {
                    bad(format!(
                        "`{tensor}` maps to {file}, not a file name in this folder"
                    ))
                })?;
            if !files.iter().any(|f| f == file) {
                files.push(file.to_string());
            }
        }
        files.sort();
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        let weights = SafetensorsWeights::open(&paths, model, seed)?;
        // Every tensor the index maps is where it says.
        let mut held: HashMap<&str, std::collections::HashSet<String>> = HashMap::new();
        for (i, (file, (path, handle))) in files.iter().zip(&weights.files).enumerate() {
            let names = read_header(path, handle, i)?
                .into_iter()
                .map(|l| l.name)
                .collect();
            held.insert(file.as_str(), names);
        }
        for (tensor, file) in map {
            let file = file.as_str().unwrap_or_default();
            if !held.get(file).is_some_and(|names| names.contains(tensor)) {
                return Err(bad(format!(
                    "`{tensor}` is mapped to {file}, which does not hold it"
                )));
            }
        }
        Ok(weights)
    }

    /// What matched: parameters the files lack (initialised fresh) and tensors no parameter
    /// takes.
    pub fn report(&self) -> &LoadReport {
        &self.report
    }
}

/// Bytes read at a time by [`SafetensorsWeights::read_rows`].
const PIECE_BYTES: usize = 4 << 20;

impl SafetensorsWeights {
    /// The file tensor for `spec`, its shape and float dtype checked; `None` when
    /// the files lack it.
    fn locate(&self, spec: &ParamSpec) -> Result<Option<&Located>> {
        let Some(t) = self.tensors.get(&spec.name) else {
            return Ok(None);
        };
        let (path, _) = &self.files[t.file];
        if t.shape != spec.shape {
            return Err(wrong_shape(
                &path.display().to_string(),
                &t.name,
                &t.shape,
                &spec.shape,
            ));
        }
        match t.dtype {
            Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64 => Ok(Some(t)),
            other => Err(candle_core::Error::Msg(format!(
                "{}: tensor `{}`: dtype {other} is not a float type",
                path.display(),
                t.name
            ))),
        }
    }

    /// Elements `first..first + out.len()` of tensor `t` as f32.
    fn read_elements(&self, t: &Located, first: usize, out: &mut [f32]) -> Result<()> {
        let (path, file) = &self.files[t.file];
        let width = t.width();
        let mut bytes = vec![0u8; out.len() * width];
        file.read_exact_at(&mut bytes, t.bytes.0 + (first * width) as u64)
            .map_err(|e| io_error(path, &format!("reading `{}` from", t.name), e))?;
        let chunks = bytes.chunks_exact(width).zip(out.iter_mut());
        match t.dtype {
            Dtype::F32 => {
                chunks.for_each(|(c, o)| *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            }
            Dtype::F64 => chunks.for_each(|(c, o)| {
                *o = f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32
            }),
            Dtype::F16 => chunks.for_each(|(c, o)| *o = f16::from_le_bytes([c[0], c[1]]).to_f32()),
            _ => chunks.for_each(|(c, o)| *o = bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        }
        Ok(())
    }

    fn fresh(&self, spec: &ParamSpec) -> Vec<f32> {
        SeededWeights(self.seed).fresh(spec)
    }
}

impl WeightSource for SafetensorsWeights {
    fn values(&self, spec: &ParamSpec) -> Result<Vec<f32>> {
        let Some(t) = self.locate(spec)? else {
            return Ok(self.fresh(spec));
        };
        let mut out = vec![0f32; t.shape.iter().product()];
        self.read_elements(t, 0, &mut out)?;
        Ok(out)
    }

    fn read_rows(
        &self,
        spec: &ParamSpec,
        take: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let Some(t) = self.locate(spec)? else {
            return take(0, &self.fresh(spec));
        };
        let rows = t.shape.first().copied().unwrap_or(1);
        let row_elems: usize = t.shape.iter().skip(1).product();
        let per_piece = (PIECE_BYTES / (row_elems * t.width()).max(1)).max(1);
        let mut piece = Vec::new();
        let mut first = 0;
        while first < rows {
            let n = per_piece.min(rows - first);
            piece.resize(n * row_elems, 0.0);
            self.read_elements(t, first * row_elems, &mut piece)?;
            take(first, &piece)?;
            first += n;
        }
        Ok(())
    }
}

fn io_error(path: &Path, doing: &str, e: std::io::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{doing} {}: {e}", path.display()))
}

/// The tensors a safetensors file lists. The header is checked by the safetensors crate's own
/// rules (tensors back to back, each one's bytes matching its dtype and shape), and its data
/// against the file's size, reading the header alone.
fn read_header(path: &Path, file: &File, index: usize) -> Result<Vec<Located>> {
    let bad = |why: &str| candle_core::Error::Msg(format!("{}: {why}", path.display()));
    let size = file
        .metadata()
        .map_err(|e| io_error(path, "reading", e))?
        .len();
    let mut len = [0u8; 8];
    file.read_exact_at(&mut len, 0)
        .map_err(|_| bad("too short for a safetensors header"))?;
    let header_len = u64::from_le_bytes(len);
    // safetensors caps headers at 100 MB.
    if header_len > 100_000_000 || header_len > size.saturating_sub(8) {
        return Err(bad(
            "header length out of range (not a safetensors file, or truncated)",
        ));
    }
    let mut head = vec![0u8; header_len as usize];
    file.read_exact_at(&mut head, 8)
        .map_err(|e| io_error(path, "reading", e))?;
    let header: Metadata =
        serde_json::from_slice(&head).map_err(|e| bad(&format!("bad header: {e}")))?;
    let data_start = 8 + header_len;
    let data_len = header.data_len() as u64;
    if data_start + data_len > size {
        return Err(bad(&format!(
            "its header lists {data_len} data bytes, the file holds {} (truncated?)",
            size - data_start
        )));
    }
    Ok(header
        .tensors()
        .into_iter()
        .map(|(name, info)| Located {
            file: index,
            name,
            dtype: info.dtype,
            shape: info.shape.clone(),
            bytes: (
                data_start + info.data_offsets.0 as u64,
                data_start + info.data_offsets.1 as u64,
            ),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Init;

    fn spec(name: &str, shape: &[usize]) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            init: Init::Normal { std: 0.02 },
            requires_grad: true,
            sparse_grad: false,
            packing: None,
        }
    }

    #[test]
    fn reads_whole_tensors_and_pieces_of_rows_in_any_float_type() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        // 3000 x 400 f32 is 4.8 MB: read in two pieces of rows.
        let big: Vec<f32> = (0..3000 * 400).map(|i| (i % 977) as f32 * 0.5).collect();
        let small = [1.5f32, -2.25, 3.0];
        let tensors: HashMap<String, Tensor> = [
            (
                "big".to_string(),
                Tensor::from_vec(big.clone(), (3000, 400), &Device::Cpu).unwrap(),
            ),
            (
                "half".to_string(),
                Tensor::new(&small, &Device::Cpu)
                    .unwrap()
                    .to_dtype(candle_core::DType::BF16)
                    .unwrap(),
            ),
        ]
        .into_iter()
        .collect();
        candle_core::safetensors::save(&tensors, &path).unwrap();
        let normal = Init::Normal { std: 0.02 };
        let model = ModuleInfo::new(String::new(), "M")
            .param("big", &[3000, 400], normal)
            .param("half", &[3], normal)
            .param("head", &[2, 2], normal);
        let w = SafetensorsWeights::open(std::slice::from_ref(&path), &model, 0).unwrap();
        assert_eq!(w.report().missing, ["head"]);
        assert_eq!(w.values(&spec("big", &[3000, 400])).unwrap(), big);
        let mut pieces = Vec::new();
        let mut joined = Vec::new();
        w.read_rows(&spec("big", &[3000, 400]), &mut |first, piece| {
            pieces.push(first);
            joined.extend_from_slice(piece);
            Ok(())
        })
        .unwrap();
        assert!(pieces.len() > 1 && pieces[0] == 0, "{pieces:?}");
        assert_eq!(joined, big);
        assert_eq!(w.values(&spec("half", &[3])).unwrap(), small);
        // Wrong shape: named with the file.
        let err = w.values(&spec("half", &[4])).unwrap_err().to_string();
        assert!(
            err.contains("w.safetensors") && err.contains("half"),
            "{err}"
        );
        // Absent: the seeded initialisation.
        let fresh = w.values(&spec("head", &[2, 2])).unwrap();
        let want: Vec<f32> = spec("head", &[2, 2])
            .initial_values(0)
            .into_iter()
            .map(|x| x as f32)
            .collect();
        assert_eq!(fresh, want);
    }

    #[test]
    fn a_file_that_is_not_safetensors_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("junk.safetensors");
        std::fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk").unwrap();
        let model = ModuleInfo::new(String::new(), "M");
        let err = SafetensorsWeights::open(&[path], &model, 0)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("junk.safetensors") && err.contains("header"),
            "{err}"
        );
    }

    /// A safetensors file: `header` then `data_bytes` zero bytes.
    fn write_safetensors(path: &Path, header: &str, data_bytes: usize) {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data_bytes, 0);
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn inconsistent_headers_and_short_data_are_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let model = ModuleInfo::new(String::new(), "M").param("w", &[2, 2], Init::Zeros);
        let cases = [
            // 12 bytes for 4 f32 values.
            (
                r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#,
                12,
                "header",
            ),
            // A gap between two tensors.
            (
                r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"v":{"dtype":"F32","shape":[1],"data_offsets":[20,24]}}"#,
                24,
                "header",
            ),
            // No dtype.
            (
                r#"{"w":{"shape":[2,2],"data_offsets":[0,16]}}"#,
                16,
                "header",
            ),
            // The data cut short.
            (
                r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#,
                10,
                "truncated",
            ),
        ];
        for (i, (header, data_bytes, why)) in cases.into_iter().enumerate() {
            let path = dir.path().join(format!("case{i}.safetensors"));
            write_safetensors(&path, header, data_bytes);
            let err = SafetensorsWeights::open(std::slice::from_ref(&path), &model, 0)
                .err()
                .unwrap_or_else(|| panic!("case {i} was accepted"))
                .to_string();
            assert!(
                err.contains(&format!("case{i}.safetensors")) && err.contains(why),
                "case {i}: {err}"
            );
        }
        // The consistent file is read.
        let path = dir.path().join("good.safetensors");
        write_safetensors(&path, cases[3].0, 16);
        let w = SafetensorsWeights::open(std::slice::from_ref(&path), &model, 0).unwrap();
        assert_eq!(w.values(&spec("w", &[2, 2])).unwrap(), [0.0; 4]);
    }
}
