//! Hugging Face checkpoints: `model.safetensors` or a sharded `model.safetensors.index.json`
//! read into a `VarStore` by weight name, and written back in the same format.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde::Deserialize;
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// The single-file checkpoint name.
pub(crate) const SAFETENSORS: &str = "model.safetensors";
/// The sharded checkpoint index name.
pub(crate) const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

#[derive(Debug, Clone, Deserialize)]
struct TensorInfo {
    dtype: String,
    shape: Vec<i64>,
    data_offsets: (u64, u64),
}

/// One shard: its path and where its data section starts.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    data_start: u64,
}

/// An opened checkpoint: the header of every shard, tensors read on demand.
#[derive(Debug)]
pub(crate) struct Checkpoint {
    /// What error messages name: the file, or the index of a sharded checkpoint.
    pub(crate) path: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, (usize, TensorInfo)>,
}

fn read_header(path: &Path) -> Result<(u64, HashMap<String, TensorInfo>)> {
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| Error::io(path, e))?;
    let len = u64::from_le_bytes(len);
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len > file_len.saturating_sub(8) || len > 100_000_000 {
        return Err(Error::format(
            path,
            format!("safetensors header of {len} bytes does not fit the file"),
        ));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header)
        .map_err(|e| Error::io(path, e))?;
    let mut raw: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| Error::format(path, format!("safetensors header: {e}")))?;
    raw.remove("__metadata__");
    let mut tensors = HashMap::new();
    for (name, v) in raw {
        let info: TensorInfo = serde_json::from_value(v)
            .map_err(|e| Error::format(path, format!("safetensors entry `{name}`: {e}")))?;
        tensors.insert(name, info);
    }
    Ok((8 + len, tensors))
}

fn kind_of(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "F32" => Kind::Float,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        "F64" => Kind::Double,
        "I64" => Kind::Int64,
        "I32" => Kind::Int,
        "I16" => Kind::Int16,
        "I8" => Kind::Int8,
        "U8" => Kind::Uint8,
        "BOOL" => Kind::Bool,
        _ => return None,
    })
}

impl Checkpoint {
    /// Opens `dir/model.safetensors`, or the shards listed in `dir/model.safetensors.index.json`.
    pub(crate) fn open(dir: &Path) -> Result<Checkpoint> {
        let single = dir.join(SAFETENSORS);
        let index = dir.join(SAFETENSORS_INDEX);
        let (path, files): (PathBuf, Vec<PathBuf>) = if single.is_file() {
            (single.clone(), vec![single])
        } else if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::format(&index, e.to_string()))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::format(&index, "no `weight_map` object"))?;
            let mut files: Vec<PathBuf> = map
                .values()
                .filter_map(|v| v.as_str())
                .map(|f| dir.join(f))
                .collect();
            files.sort();
            files.dedup();
            (index.clone(), files)
        } else {
            return Err(Error::format(
                dir,
                format!("neither {SAFETENSORS} nor {SAFETENSORS_INDEX} found"),
            ));
        };
        let mut shards = Vec::new();
        let mut tensors = HashMap::new();
        for (i, file) in files.into_iter().enumerate() {
            let (data_start, infos) = read_header(&file)?;
            for (name, info) in infos {
                tensors.insert(name, (i, info));
            }
            shards.push(Shard {
                path: file,
                data_start,
            });
        }
        Ok(Checkpoint {
            path,
            shards,
            tensors,
        })
    }

    /// Whether the checkpoint holds `name`.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The shape stored for `name`.
    pub(crate) fn shape(&self, name: &str) -> Option<&[i64]> {
        self.tensors
            .get(name)
            .map(|(_, info)| info.shape.as_slice())
    }

    /// Reads `name` into a CPU tensor of its stored dtype.
    pub(crate) fn read(&self, name: &str) -> Result<Tensor> {
        let missing = || Error::MissingTensor {
            path: self.path.display().to_string(),
            name: name.to_owned(),
        };
        let (shard, info) = self.tensors.get(name).ok_or_else(missing)?;
        let shard = &self.shards[*shard];
        let path = &shard.path;
        let kind = kind_of(&info.dtype).ok_or_else(|| {
            Error::format(
                path,
                format!("tensor `{name}` has unsupported dtype {}", info.dtype),
            )
        })?;
        let (start, end) = info.data_offsets;
        let numel: i64 = info.shape.iter().product();
        if end < start || (end - start) as usize != numel as usize * kind.elt_size_in_bytes() {
            return Err(Error::format(
                path,
                format!("tensor `{name}`: data offsets {start}..{end} do not fit its shape"),
            ));
        }
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        file.seek(SeekFrom::Start(shard.data_start + start))
            .map_err(|e| Error::io(path, e))?;
        let mut bytes = vec![0u8; (end - start) as usize];
        file.read_exact(&mut bytes)
            .map_err(|e| Error::io(path, e))?;
        Ok(Tensor::f_from_data_size(&bytes, &info.shape, kind)?)
    }
}

/// Fills every variable of `vs` from `ckpt` by name, converting dtype and device. Variables the
/// checkpoint lacks are an error unless `may_be_fresh(name)`, in which case they keep their
/// init and their names are returned.
pub(crate) fn load_into(
    vs: &VarStore,
    ckpt: &Checkpoint,
    may_be_fresh: &dyn Fn(&str) -> bool,
) -> Result<Vec<String>> {
    let vars: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
    let mut fresh = Vec::new();
    for (name, var) in vars {
        let Some(shape) = ckpt.shape(&name) else {
            if may_be_fresh(&name) {
                fresh.push(name);
                continue;
            }
            return Err(Error::MissingTensor {
                path: ckpt.path.display().to_string(),
                name,
            });
        };
        if shape != var.size().as_slice() {
            return Err(Error::TensorShape {
                path: ckpt.path.display().to_string(),
                name,
                expected: var.size(),
                got: shape.to_vec(),
            });
        }
        let value = ckpt
            .read(&name)?
            .f_to_kind(var.kind())?
            .f_to_device(var.device())?;
        tch::no_grad(|| var.shallow_clone().f_copy_(&value))?;
    }
    Ok(fresh)
}

struct Bytes {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for &Bytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        _ => return None,
    })
}

/// Writes named tensors to one safetensors file with `{"format": "pt"}` metadata, as
/// transformers' `save_pretrained` does.
pub(crate) fn write_safetensors(tensors: &[(String, Tensor)], path: &Path) -> Result<()> {
    let mut owned = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let t = t.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
        let dtype = dtype_of(t.kind()).ok_or_else(|| {
            Error::format(
                path,
                format!("tensor `{name}` has unsupported dtype {:?}", t.kind()),
            )
        })?;
        let numel = t.numel();
        let mut data = vec![0u8; numel * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut data, numel)?;
        let shape = t.size().iter().map(|&d| d as usize).collect();
        owned.push((name.clone(), Bytes { dtype, shape, data }));
    }
    let views: Vec<(&str, &Bytes)> = owned.iter().map(|(n, b)| (n.as_str(), b)).collect();
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| Error::format(path, e.to_string()))
}

/// Writes named tensors to `dir/model.safetensors`.
pub(crate) fn save_tensors(tensors: &[(String, Tensor)], dir: &Path) -> Result<()> {
    write_safetensors(tensors, &dir.join(SAFETENSORS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_keeps_names_dtypes_and_values() {
        let dir = tempfile::tempdir().unwrap();
        let a = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).view([2, 3]);
        let b = Tensor::from_slice(&[1i64, -2]).to_kind(Kind::BFloat16);
        let path = dir.path().join(SAFETENSORS);
        write_safetensors(
            &[
                ("x.weight".to_owned(), a.shallow_clone()),
                ("y".to_owned(), b.shallow_clone()),
            ],
            &path,
        )
        .unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ckpt.shape("x.weight"), Some(&[2i64, 3][..]));
        assert!(ckpt.read("x.weight").unwrap().equal(&a));
        let y = ckpt.read("y").unwrap();
        assert_eq!(y.kind(), Kind::BFloat16);
        assert!(y.equal(&b));
        let err = ckpt.read("z").unwrap_err().to_string();
        assert!(err.contains("missing tensor `z`"), "{err}");
    }

    #[test]
    fn missing_checkpoint_names_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("model.safetensors"), "{err}");
    }
}
