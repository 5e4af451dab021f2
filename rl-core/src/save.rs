//! `Batch::save` / `Batch::load`: one safetensors file holding the tensors, with the columns and
//! `meta_info` as JSON in its metadata header. Round trips are bit-exact, dtypes included.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tch::{Device, Tensor};

use crate::batch::{Batch, dtype_of, kind_of_dtype};
use crate::error::{Error, Result};

/// The metadata key under which the non-tensor part is stored.
const META_KEY: &str = "rl_core.batch";
const FORMAT_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Header {
    format_version: u32,
    columns: BTreeMap<String, Vec<Value>>,
    meta_info: Map<String, Value>,
}

struct Raw {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl safetensors::View for &Raw {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

impl Batch {
    /// Writes the batch to `path` (one safetensors file), atomically: a temporary file in the
    /// same folder is written, fsynced and renamed over `path`.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let mut raws = Vec::new();
        for key in self.tensor_keys() {
            let t = self.get(key)?;
            let dtype = dtype_of(t.kind()).ok_or_else(|| Error::Dtype {
                key: key.to_owned(),
                expected: "bool, u8, i8, i16, i32, i64, f16, bf16, f32 or f64".into(),
                got: t.kind(),
            })?;
            let t = t.f_to_device(Device::Cpu)?.f_contiguous()?;
            let numel = t.numel();
            let mut bytes = vec![0u8; numel * t.kind().elt_size_in_bytes()];
            t.f_copy_data_u8(&mut bytes, numel)?;
            let shape = t.size().iter().map(|&d| d as usize).collect();
            raws.push((
                key.to_owned(),
                Raw {
                    dtype,
                    shape,
                    bytes,
                },
            ));
        }
        let header = Header {
            format_version: FORMAT_VERSION,
            columns: self
                .column_keys()
                .map(|k| (k.to_owned(), self.column(k).unwrap().to_vec()))
                .collect(),
            meta_info: self.meta_info().clone(),
        };
        let header = serde_json::to_string(&header).map_err(|e| Error::Format {
            path: path.display().to_string(),
            reason: format!("cannot encode columns and meta_info as JSON: {e}"),
        })?;
        let meta = HashMap::from([(META_KEY.to_owned(), header)]);
        let bytes = safetensors::serialize(raws.iter().map(|(k, r)| (k.as_str(), r)), Some(meta))
            .map_err(|e| Error::Format {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;

        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let file_name = path
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
        let mut file = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
        file.write_all(&bytes).map_err(io_err(&tmp))?;
        file.sync_all().map_err(io_err(&tmp))?;
        drop(file);
        std::fs::rename(&tmp, path).map_err(io_err(path))?;
        Ok(())
    }

    /// Reads a batch written by [`save`](Batch::save), placing its tensors on `device`.
    pub fn load(path: impl AsRef<Path>, device: Device) -> Result<Batch> {
        let path = path.as_ref();
        let shown = || path.display().to_string();
        let bytes = std::fs::read(path).map_err(io_err(path))?;
        let format = |reason: String| Error::Format {
            path: shown(),
            reason,
        };
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| format(format!("not a safetensors file: {e}")))?;
        let header = metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get(META_KEY))
            .ok_or_else(|| {
                format(format!(
                    "no `{META_KEY}` metadata: not written by Batch::save"
                ))
            })?;
        let header: Header = serde_json::from_str(header)
            .map_err(|e| format(format!("bad `{META_KEY}` metadata: {e}")))?;
        if header.format_version != FORMAT_VERSION {
            return Err(format(format!(
                "format version {} is not the supported {FORMAT_VERSION}",
                header.format_version
            )));
        }
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| format(format!("not a safetensors file: {e}")))?;
        let mut out = Batch::new();
        let mut names = st.names();
        names.sort_unstable();
        for name in names {
            let view = st.tensor(name).map_err(|e| format(e.to_string()))?;
            let kind = kind_of_dtype(view.dtype()).ok_or_else(|| {
                format(format!(
                    "tensor `{name}` has unsupported dtype {:?}",
                    view.dtype()
                ))
            })?;
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let t = Tensor::f_from_data_size(view.data(), &shape, kind)?.f_to_device(device)?;
            out.insert(name, t).map_err(|e| format(e.to_string()))?;
        }
        for (key, values) in header.columns {
            out.insert_column(key, values)
                .map_err(|e| format(e.to_string()))?;
        }
        *out.meta_info_mut() = header.meta_info;
        Ok(out)
    }
}
