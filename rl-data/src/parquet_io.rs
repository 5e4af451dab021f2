//! Reading and writing parquet: projected record batches, Arrow → JSON values, verl's schema.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Float64Array, Int64Array, ListArray, RecordBatch,
    StringArray, StructArray,
};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{
    DataType, Field, Fields, Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type,
    Int64Type, Schema, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::tokenizer::Message;

/// Rows per Arrow batch when reading.
pub(crate) const READ_BATCH_ROWS: usize = 8192;

fn parquet_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Parquet {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Opens `path` as parquet and returns a reader builder, turning an empty or corrupt file into
/// an error that names it.
pub(crate) fn open_builder(path: &Path) -> Result<ParquetRecordBatchReaderBuilder<File>> {
    let file = File::open(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let len = file
        .metadata()
        .map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    if len == 0 {
        return Err(Error::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| parquet_err(path, e))
}

/// The file's top-level columns and their Arrow types.
pub(crate) fn schema_of(builder: &ParquetRecordBatchReaderBuilder<File>) -> Arc<Schema> {
    builder.schema().clone()
}

/// Comma-separated column names, for error messages.
pub(crate) fn column_list(schema: &Schema) -> String {
    schema
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Record batches read one at a time.
pub(crate) type BatchIter = Box<dyn Iterator<Item = Result<RecordBatch>>>;

/// A streaming reader over `columns` of `path` (top-level names; missing ones are an error).
pub(crate) fn read_columns(path: &Path, columns: &[&str]) -> Result<(Arc<Schema>, BatchIter)> {
    let builder = open_builder(path)?;
    let schema = schema_of(&builder);
    let mut roots = Vec::with_capacity(columns.len());
    for c in columns {
        let idx = schema.index_of(c).map_err(|_| Error::MissingColumn {
            path: path.to_path_buf(),
            column: (*c).to_string(),
            present: column_list(&schema),
        })?;
        roots.push(idx);
    }
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let reader = builder
        .with_projection(mask)
        .with_batch_size(READ_BATCH_ROWS)
        .build()
        .map_err(|e| parquet_err(path, e))?;
    let path: PathBuf = path.to_path_buf();
    let projected = arrow::record_batch::RecordBatchReader::schema(&reader);
    Ok((
        projected,
        Box::new(reader.map(move |b| b.map_err(|e| parquet_err(&path, e)))),
    ))
}

/// Short Arrow type name for messages (`list<struct<role, content>>`).
pub(crate) fn type_name(dt: &DataType) -> String {
    match dt {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "string".into(),
        DataType::List(f) | DataType::LargeList(f) | DataType::ListView(f) => {
            format!("list<{}>", type_name(f.data_type()))
        }
        DataType::Struct(fields) => format!(
            "struct<{}>",
            fields
                .iter()
                .map(|f| f.name().as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => format!("{other}").to_lowercase(),
    }
}

/// The string at `row` of a string column, `None` if null; `Err(type name)` if not a string.
pub(crate) fn string_at(arr: &dyn Array, row: usize) -> std::result::Result<Option<&str>, String> {
    if arr.is_null(row) {
        return Ok(None);
    }
    match arr.data_type() {
        DataType::Utf8 => Ok(Some(arr.as_string::<i32>().value(row))),
        DataType::LargeUtf8 => Ok(Some(arr.as_string::<i64>().value(row))),
        DataType::Utf8View => Ok(Some(arr.as_string_view().value(row))),
        other => Err(type_name(other)),
    }
}

/// Is this column a string column?
pub(crate) fn is_string(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    )
}

/// Is this column a list of `{role, content}` structs with string fields?
pub(crate) fn is_message_list(dt: &DataType) -> bool {
    match dt {
        DataType::List(f) | DataType::LargeList(f) => match f.data_type() {
            DataType::Struct(fields) => ["role", "content"].iter().all(|k| {
                fields
                    .iter()
                    .any(|f| f.name() == k && is_string(f.data_type()))
            }),
            _ => false,
        },
        _ => false,
    }
}

/// The prompt at `row`: a message list, or a plain string as one user message.
/// `Err(what is wrong)` for a null or malformed value.
pub(crate) fn messages_at(
    arr: &dyn Array,
    row: usize,
) -> std::result::Result<Vec<Message>, String> {
    if arr.is_null(row) {
        return Err("null".into());
    }
    let (values, range) = match arr.data_type() {
        dt if is_string(dt) => {
            let s = string_at(arr, row)?.unwrap_or_default();
            return Ok(vec![Message::user(s)]);
        }
        DataType::List(_) => {
            let l = arr.as_list::<i32>();
            let o = l.value_offsets();
            (l.values(), o[row] as usize..o[row + 1] as usize)
        }
        DataType::LargeList(_) => {
            let l = arr.as_list::<i64>();
            let o = l.value_offsets();
            (l.values(), o[row] as usize..o[row + 1] as usize)
        }
        other => return Err(type_name(other)),
    };
    let st = values
        .as_struct_opt()
        .ok_or_else(|| type_name(arr.data_type()))?;
    let role = st
        .column_by_name("role")
        .ok_or("a message without `role`")?;
    let content = st
        .column_by_name("content")
        .ok_or("a message without `content`")?;
    let mut out = Vec::with_capacity(range.len());
    for i in range {
        let r = string_at(role.as_ref(), i)?.ok_or("a message with a null role")?;
        // A null content is rendered as empty, as Python's `None` would fail later anyway.
        let c = string_at(content.as_ref(), i)?.unwrap_or_default();
        out.push(Message::new(r, c));
    }
    Ok(out)
}

/// Any Arrow value as JSON (structs → objects, lists → arrays); `Err(type)` for binary etc.
pub(crate) fn json_at(arr: &dyn Array, row: usize) -> std::result::Result<Value, String> {
    if arr.is_null(row) {
        return Ok(Value::Null);
    }
    macro_rules! num {
        ($t:ty) => {
            Value::from(arr.as_primitive::<$t>().value(row))
        };
    }
    Ok(match arr.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(arr.as_boolean().value(row)),
        DataType::Int8 => num!(Int8Type),
        DataType::Int16 => num!(Int16Type),
        DataType::Int32 => num!(Int32Type),
        DataType::Int64 => num!(Int64Type),
        DataType::UInt8 => num!(UInt8Type),
        DataType::UInt16 => num!(UInt16Type),
        DataType::UInt32 => num!(UInt32Type),
        DataType::UInt64 => num!(UInt64Type),
        DataType::Float16 => Value::from(f64::from(arr.as_primitive::<Float16Type>().value(row))),
        DataType::Float32 => Value::from(f64::from(arr.as_primitive::<Float32Type>().value(row))),
        DataType::Float64 => num!(Float64Type),
        dt if is_string(dt) => Value::String(string_at(arr, row)?.unwrap_or_default().to_string()),
        DataType::List(_) => {
            let l = arr.as_list::<i32>();
            let v = l.value(row);
            (0..v.len())
                .map(|i| json_at(v.as_ref(), i))
                .collect::<std::result::Result<_, _>>()?
        }
        DataType::LargeList(_) => {
            let l = arr.as_list::<i64>();
            let v = l.value(row);
            (0..v.len())
                .map(|i| json_at(v.as_ref(), i))
                .collect::<std::result::Result<_, _>>()?
        }
        DataType::FixedSizeList(_, _) => {
            let l = arr.as_fixed_size_list();
            let v = l.value(row);
            (0..v.len())
                .map(|i| json_at(v.as_ref(), i))
                .collect::<std::result::Result<_, _>>()?
        }
        DataType::Struct(_) => {
            let s = arr.as_struct();
            let mut m = serde_json::Map::new();
            for (f, col) in s.fields().iter().zip(s.columns()) {
                m.insert(f.name().clone(), json_at(col.as_ref(), row)?);
            }
            Value::Object(m)
        }
        DataType::Map(_, _) => {
            let mp = arr.as_map();
            let entries = mp.value(row);
            let (keys, vals) = (entries.column(0), entries.column(1));
            let mut m = serde_json::Map::new();
            for i in 0..entries.len() {
                let k = match json_at(keys.as_ref(), i)? {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                m.insert(k, json_at(vals.as_ref(), i)?);
            }
            Value::Object(m)
        }
        other => return Err(type_name(other)),
    })
}

/// Can [`json_at`] read this type?
pub(crate) fn is_json_readable(dt: &DataType) -> bool {
    match dt {
        DataType::Null
        | DataType::Boolean
        | DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::UInt64
        | DataType::Float16
        | DataType::Float32
        | DataType::Float64 => true,
        dt if is_string(dt) => true,
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) => {
            is_json_readable(f.data_type())
        }
        DataType::Struct(fs) => fs.iter().all(|f| is_json_readable(f.data_type())),
        DataType::Map(f, _) => is_json_readable(f.data_type()),
        _ => false,
    }
}

/// One row in verl's RL schema, as written by the preprocessors and generators.
#[derive(Debug, Clone, PartialEq)]
pub struct RlRecord {
    /// `data_source`: selects the reward function.
    pub data_source: String,
    /// `prompt`: the chat messages.
    pub prompt: Vec<Message>,
    /// `ability`: a free-form tag (`math`).
    pub ability: String,
    /// `reward_model.style` (`rule`).
    pub style: String,
    /// `reward_model.ground_truth`: a string, a number, a list or an object (`{target, numbers}`).
    pub ground_truth: Value,
    /// `extra_info`: the same keys in every row.
    pub extra_info: serde_json::Map<String, Value>,
}

fn utf8(values: impl IntoIterator<Item = String>) -> ArrayRef {
    Arc::new(StringArray::from_iter_values(values))
}

/// The Arrow column for JSON values that share a shape: strings, bools, integers, floats,
/// lists and objects (fields in first-seen order); mixed shapes become JSON text.
fn json_column(values: &[&Value]) -> (DataType, ArrayRef) {
    #[derive(PartialEq)]
    enum Kind {
        Null,
        Bool,
        Int,
        Float,
        Str,
        List,
        Obj,
        Mixed,
    }
    let mut kind = Kind::Null;
    for v in values {
        let k = match v {
            Value::Null => continue,
            Value::Bool(_) => Kind::Bool,
            Value::Number(n) if n.is_i64() => Kind::Int,
            Value::Number(_) => Kind::Float,
            Value::String(_) => Kind::Str,
            Value::Array(_) => Kind::List,
            Value::Object(_) => Kind::Obj,
        };
        kind = match (kind, k) {
            (Kind::Null, k) => k,
            (Kind::Int, Kind::Float) | (Kind::Float, Kind::Int) => Kind::Float,
            (a, b) if a == b => a,
            _ => Kind::Mixed,
        };
    }
    match kind {
        Kind::Bool => (
            DataType::Boolean,
            Arc::new(values.iter().map(|v| v.as_bool()).collect::<BooleanArray>()),
        ),
        Kind::Int => (
            DataType::Int64,
            Arc::new(values.iter().map(|v| v.as_i64()).collect::<Int64Array>()),
        ),
        Kind::Float => (
            DataType::Float64,
            Arc::new(values.iter().map(|v| v.as_f64()).collect::<Float64Array>()),
        ),
        Kind::List => {
            let empty = Vec::new();
            let items: Vec<&Value> = values
                .iter()
                .flat_map(|v| v.as_array().unwrap_or(&empty).iter())
                .collect();
            let (dt, child) = json_column(&items);
            let offsets =
                OffsetBuffer::from_lengths(values.iter().map(|v| v.as_array().map_or(0, Vec::len)));
            let nulls: arrow::buffer::NullBuffer = values.iter().map(|v| !v.is_null()).collect();
            let field = Arc::new(Field::new("item", dt, true));
            let arr = ListArray::new(field, offsets, child, Some(nulls));
            (arr.data_type().clone(), Arc::new(arr))
        }
        Kind::Obj => {
            let mut keys: Vec<String> = Vec::new();
            for v in values {
                if let Value::Object(m) = v {
                    for k in m.keys() {
                        if !keys.contains(k) {
                            keys.push(k.clone());
                        }
                    }
                }
            }
            let mut fields = Vec::new();
            let mut cols = Vec::new();
            for k in &keys {
                let col: Vec<&Value> = values
                    .iter()
                    .map(|v| v.get(k).unwrap_or(&Value::Null))
                    .collect();
                let (dt, arr) = json_column(&col);
                fields.push(Field::new(k, dt, true));
                cols.push(arr);
            }
            let nulls: arrow::buffer::NullBuffer = values.iter().map(|v| !v.is_null()).collect();
            let arr = if keys.is_empty() {
                StructArray::new_empty_fields(values.len(), Some(nulls))
            } else {
                StructArray::new(Fields::from(fields), cols, Some(nulls))
            };
            (arr.data_type().clone(), Arc::new(arr))
        }
        Kind::Null | Kind::Str | Kind::Mixed => (
            DataType::Utf8,
            Arc::new(
                values
                    .iter()
                    .map(|v| match v {
                        Value::Null => None,
                        Value::String(s) => Some(s.clone()),
                        other => Some(other.to_string()),
                    })
                    .collect::<StringArray>(),
            ),
        ),
    }
}

/// Writes `records` as verl-schema parquet (snappy), deterministically: the same records give
/// the same bytes.
pub fn write_rl_parquet(path: &Path, records: &[RlRecord]) -> Result<()> {
    let data_source = utf8(records.iter().map(|r| r.data_source.clone()));
    let ability = utf8(records.iter().map(|r| r.ability.clone()));

    let prompt = messages_column(records.iter().map(|r| r.prompt.as_slice()));

    let (gt_type, gt) = json_column(&records.iter().map(|r| &r.ground_truth).collect::<Vec<_>>());
    let rm_fields = Fields::from(vec![
        Field::new("style", DataType::Utf8, true),
        Field::new("ground_truth", gt_type, true),
    ]);
    let reward_model: ArrayRef = Arc::new(StructArray::new(
        rm_fields,
        vec![utf8(records.iter().map(|r| r.style.clone())), gt],
        None,
    ));

    let mut fields = vec![
        Field::new("data_source", DataType::Utf8, true),
        Field::new("prompt", prompt.data_type().clone(), true),
        Field::new("ability", DataType::Utf8, true),
        Field::new("reward_model", reward_model.data_type().clone(), true),
    ];
    let mut columns = vec![data_source, prompt, ability, reward_model];
    // Parquet cannot hold a struct without fields: with no extra_info keys the column is left
    // out (readers then see `extra_info = null`).
    if records.iter().any(|r| !r.extra_info.is_empty()) {
        let extra: Vec<Value> = records
            .iter()
            .map(|r| Value::Object(r.extra_info.clone()))
            .collect();
        let (_, extra_info) = json_column(&extra.iter().collect::<Vec<_>>());
        fields.push(Field::new(
            "extra_info",
            extra_info.data_type().clone(),
            true,
        ));
        columns.push(extra_info);
    }
    let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)
        .map_err(|e| parquet_err(path, e))?;
    write_batches(path, &[batch])
}

/// A `list<struct<role, content>>` column of chat messages, one list per row.
fn messages_column<'a>(lists: impl Iterator<Item = &'a [Message]> + Clone) -> ArrayRef {
    let msg_fields = Fields::from(vec![
        Field::new("role", DataType::Utf8, true),
        Field::new("content", DataType::Utf8, true),
    ]);
    let flat: Vec<&Message> = lists.clone().flatten().collect();
    let msgs = StructArray::new(
        msg_fields.clone(),
        vec![
            utf8(flat.iter().map(|m| m.role.clone())),
            utf8(flat.iter().map(|m| m.content.clone())),
        ],
        None,
    );
    let offsets = OffsetBuffer::from_lengths(lists.map(<[Message]>::len));
    let item = Arc::new(Field::new("item", DataType::Struct(msg_fields), true));
    Arc::new(ListArray::new(item, offsets, Arc::new(msgs), None))
}

/// One preference pair in TRL's schema.
#[derive(Debug, Clone, PartialEq)]
pub struct PreferenceRecord {
    /// `prompt`: the chat messages.
    pub prompt: Vec<Message>,
    /// `chosen`: the preferred response.
    pub chosen: String,
    /// `rejected`: the dispreferred response.
    pub rejected: String,
}

/// Writes preference pairs as TRL's `prompt` (messages) / `chosen` / `rejected` columns, the
/// schema [`PreferenceDataset`](crate::PreferenceDataset) reads.
pub fn write_preference_parquet(path: &Path, records: &[PreferenceRecord]) -> Result<()> {
    let prompt = messages_column(records.iter().map(|r| r.prompt.as_slice()));
    let fields = vec![
        Field::new("prompt", prompt.data_type().clone(), true),
        Field::new("chosen", DataType::Utf8, true),
        Field::new("rejected", DataType::Utf8, true),
    ];
    let columns = vec![
        prompt,
        utf8(records.iter().map(|r| r.chosen.clone())),
        utf8(records.iter().map(|r| r.rejected.clone())),
    ];
    let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)
        .map_err(|e| parquet_err(path, e))?;
    write_batches(path, &[batch])
}

/// Writes record batches to `path` (snappy), creating parent directories.
pub fn write_batches(path: &Path, batches: &[RecordBatch]) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|source| Error::Io {
            path: parent.to_path_buf(),
            source,
        })?;
    }
    let schema = batches
        .first()
        .map(|b| b.schema())
        .ok_or_else(|| Error::EmptyFile {
            path: path.to_path_buf(),
        })?;
    let file = File::create(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .build();
    let mut w = parquet::arrow::ArrowWriter::try_new(file, schema, Some(props))
        .map_err(|e| parquet_err(path, e))?;
    for b in batches {
        w.write(b).map_err(|e| parquet_err(path, e))?;
    }
    w.close().map_err(|e| parquet_err(path, e))?;
    Ok(())
}
