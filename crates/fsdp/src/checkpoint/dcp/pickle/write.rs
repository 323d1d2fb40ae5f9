//! Writing pickles (protocol 2) of the few kinds of objects a PyTorch distributed checkpoint
//! holds: plain values, references to classes and functions, calls of them, and objects
//! made by `cls.__new__(cls)` with their state — what `pickle.dumps` of DCP's data classes
//! produces, with no memo (every object is written where it occurs).

/// Something to pickle.
#[derive(Debug, Clone, PartialEq)]
pub enum Py {
    /// `None`.
    None,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// A tuple.
    Tuple(Vec<Py>),
    /// A list.
    List(Vec<Py>),
    /// A dict, in this order.
    Dict(Vec<(Py, Py)>),
    /// A class or function: (module, name).
    Global(&'static str, &'static str),
    /// `f(*args)` (`REDUCE`).
    Call(Box<Py>, Vec<Py>),
    /// An object of class (module, name) made without calling its `__init__`, with its
    /// state set (`NEWOBJ`, `BUILD`): how pickle writes a data class.
    New(&'static str, &'static str, Box<Py>),
    /// A persistent id (`BINPERSID`): how `torch.save` refers to a tensor's storage.
    Persistent(Box<Py>),
}

impl Py {
    /// A string.
    pub fn str(s: impl Into<String>) -> Py {
        Py::Str(s.into())
    }

    /// A dict with string keys.
    pub fn fields(entries: Vec<(&str, Py)>) -> Py {
        Py::Dict(entries.into_iter().map(|(k, v)| (Py::str(k), v)).collect())
    }

    /// A tuple of integers.
    pub fn ints(v: &[usize]) -> Py {
        Py::Tuple(v.iter().map(|&i| Py::Int(i as i64)).collect())
    }
}

/// The pickle of `value`, protocol 2.
pub fn dump(value: &Py) -> Vec<u8> {
    let mut out = vec![0x80, 2];
    write(value, &mut out);
    out.push(b'.');
    out
}

fn write(value: &Py, out: &mut Vec<u8>) {
    match value {
        Py::None => out.push(b'N'),
        Py::Bool(true) => out.push(0x88),
        Py::Bool(false) => out.push(0x89),
        Py::Int(i) => int(*i, out),
        Py::Float(f) => {
            out.push(b'G');
            out.extend_from_slice(&f.to_be_bytes());
        }
        Py::Str(s) => {
            out.push(b'X');
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Py::Tuple(items) => tuple(items, out),
        Py::List(items) => {
            out.push(b']');
            if !items.is_empty() {
                out.push(b'(');
                items.iter().for_each(|v| write(v, out));
                out.push(b'e');
            }
        }
        Py::Dict(entries) => {
            out.push(b'}');
            if !entries.is_empty() {
                out.push(b'(');
                for (k, v) in entries {
                    write(k, out);
                    write(v, out);
                }
                out.push(b'u');
            }
        }
        Py::Global(module, name) => global(module, name, out),
        Py::Call(f, args) => {
            write(f, out);
            tuple(args, out);
            out.push(b'R');
        }
        Py::New(module, name, state) => {
            global(module, name, out);
            out.push(b')');
            out.push(0x81);
            write(state, out);
            out.push(b'b');
        }
        Py::Persistent(id) => {
            write(id, out);
            out.push(b'Q');
        }
    }
}

fn global(module: &str, name: &str, out: &mut Vec<u8>) {
    out.push(b'c');
    for part in [module, name] {
        out.extend_from_slice(part.as_bytes());
        out.push(b'\n');
    }
}

fn tuple(items: &[Py], out: &mut Vec<u8>) {
    match items.len() {
        0 => out.push(b')'),
        n @ 1..=3 => {
            items.iter().for_each(|v| write(v, out));
            out.push([0x85, 0x86, 0x87][n - 1]);
        }
        _ => {
            out.push(b'(');
            items.iter().for_each(|v| write(v, out));
            out.push(b't');
        }
    }
}

fn int(i: i64, out: &mut Vec<u8>) {
    match i {
        0..=0xff => out.extend_from_slice(&[b'K', i as u8]),
        0x100..=0xffff => {
            out.push(b'M');
            out.extend_from_slice(&(i as u16).to_le_bytes());
        }
        _ if i32::try_from(i).is_ok() => {
            out.push(b'J');
            out.extend_from_slice(&(i as i32).to_le_bytes());
        }
        _ => {
            // LONG1: little-endian two's complement, 8 bytes.
            out.extend_from_slice(&[0x8a, 8]);
            out.extend_from_slice(&i.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Value, load};
    use super::*;

    #[test]
    fn what_is_written_reads_back() {
        let value = Py::New(
            "m",
            "C",
            Box::new(Py::fields(vec![
                ("none", Py::None),
                ("flags", Py::Tuple(vec![Py::Bool(true), Py::Bool(false)])),
                (
                    "ints",
                    Py::List(
                        [0i64, 255, 256, 65535, 65536, -1, i32::MIN as i64, 1 << 40]
                            .map(Py::Int)
                            .into(),
                    ),
                ),
                ("float", Py::Float(0.999)),
                ("text", Py::str("décalé")),
                (
                    "size",
                    Py::Call(
                        Box::new(Py::Global("torch", "Size")),
                        vec![Py::ints(&[3, 4, 5, 6])],
                    ),
                ),
                ("empty", Py::Dict(Vec::new())),
                (
                    "pid",
                    Py::Persistent(Box::new(Py::Tuple(vec![Py::str("storage")]))),
                ),
            ])),
        );
        let bytes = dump(&value);
        let read = load(&bytes, &|m, n| {
            matches!((m, n), ("m", "C") | ("torch", "Size"))
        })
        .unwrap();
        let Value::Object { class, state, .. } = &read else {
            panic!("{read:?}")
        };
        assert_eq!(class, &("m".to_string(), "C".to_string()));
        let state = state.as_deref().unwrap();
        assert_eq!(state.get("none"), Some(&Value::None));
        assert_eq!(
            state.get("flags"),
            Some(&Value::Tuple(vec![Value::Bool(true), Value::Bool(false)]))
        );
        assert_eq!(
            state.get("ints"),
            Some(&Value::List(
                [0i64, 255, 256, 65535, 65536, -1, i32::MIN as i64, 1 << 40]
                    .map(Value::Int)
                    .into()
            ))
        );
        assert_eq!(state.get("float"), Some(&Value::Float(0.999)));
        assert_eq!(state.get("text").and_then(Value::str), Some("décalé"));
        assert_eq!(
            state.get("size").and_then(Value::ints),
            Some(vec![3, 4, 5, 6])
        );
        assert_eq!(state.get("empty"), Some(&Value::Dict(Vec::new())));
        assert!(matches!(state.get("pid"), Some(Value::Persistent(_))));
    }
}
