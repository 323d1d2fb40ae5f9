//! A restricted pickle reader: it decodes protocols 2 to 5 into a tree of [`Value`]s and
//! executes nothing. A reference to a class or function (`GLOBAL`, `STACK_GLOBAL`) is
//! accepted only when the caller allows that name, and calls (`REDUCE`, `NEWOBJ`, `BUILD`)
//! are recorded as data, never run — what reading PyTorch's checkpoint metadata and tensor
//! records needs, and nothing an untrusted file could use.

use std::collections::HashMap;

/// A decoded pickle value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
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
    /// Bytes.
    Bytes(Vec<u8>),
    /// A tuple.
    Tuple(Vec<Value>),
    /// A list.
    List(Vec<Value>),
    /// A dict, in insertion order.
    Dict(Vec<(Value, Value)>),
    /// A set or frozenset.
    Set(Vec<Value>),
    /// A reference to an allowed class or function: (module, name).
    Global(String, String),
    /// A call of an allowed global (`REDUCE`, `NEWOBJ`) with its arguments, and the state
    /// `BUILD` gave it.
    Object {
        /// The class or function called: (module, name).
        class: (String, String),
        /// Its arguments.
        args: Vec<Value>,
        /// The state set by `BUILD`.
        state: Option<Box<Value>>,
    },
    /// A persistent id (`BINPERSID`): how torch.save refers to a tensor's storage.
    Persistent(Box<Value>),
}

impl Value {
    /// The entries of a dict or of an object's state dict.
    pub fn fields(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(d) => Some(d),
            Value::Object { state: Some(s), .. } => s.fields(),
            _ => None,
        }
    }

    /// Entry `key` of a dict (or object state) with string keys.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.fields()?
            .iter()
            .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
            .map(|(_, v)| v)
    }

    /// The integers of a tuple, a list or a `torch.Size`.
    pub fn ints(&self) -> Option<Vec<i64>> {
        match self {
            Value::Tuple(v) | Value::List(v) => v
                .iter()
                .map(|x| match x {
                    Value::Int(i) => Some(*i),
                    _ => None,
                })
                .collect(),
            Value::Object { args, .. } if args.len() == 1 => args[0].ints(),
            Value::Object { args, .. } if args.is_empty() => Some(Vec::new()),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Why a pickle could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PickleError {
    /// The data ends inside an opcode.
    #[error("truncated at byte {0}")]
    Truncated(usize),
    /// An opcode this reader does not take (it never runs code).
    #[error("opcode 0x{op:02x} at byte {at} is not accepted")]
    Opcode {
        /// The opcode.
        op: u8,
        /// Where.
        at: usize,
    },
    /// A reference to a class or function that is not on the allowed list.
    #[error(
        "refers to `{0}.{1}`, which is not allowed here (a pickle can run code on load; only known data classes are read)"
    )]
    Forbidden(String, String),
    /// The opcodes do not form a valid pickle.
    #[error("malformed at byte {at}: {what}")]
    Malformed {
        /// Where.
        at: usize,
        /// What is wrong.
        what: String,
    },
}

enum Item {
    Mark,
    Value(Value),
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.ok_or(PickleError::Truncated(self.at))?;
        let s = &self.data[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn le(&mut self, n: usize) -> Result<u64, PickleError> {
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(self.take(n)?);
        Ok(u64::from_le_bytes(v))
    }

    fn line(&mut self) -> Result<String, PickleError> {
        let start = self.at;
        let len = self.data[start..]
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(PickleError::Truncated(start))?;
        let s = self.take(len + 1)?;
        Ok(String::from_utf8_lossy(&s[..len]).into_owned())
    }

    fn string(&mut self, n: usize) -> Result<String, PickleError> {
        let at = self.at;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| PickleError::Malformed {
            at,
            what: "a string that is not UTF-8".into(),
        })
    }
}

/// Decodes `data`, accepting only the globals `allowed` says yes to.
pub fn load(data: &[u8], allowed: &dyn Fn(&str, &str) -> bool) -> Result<Value, PickleError> {
    let mut r = Reader { data, at: 0 };
    let mut stack: Vec<Item> = Vec::new();
    let mut memo: HashMap<u64, Value> = HashMap::new();
    let malformed = |at: usize, what: &str| PickleError::Malformed {
        at,
        what: what.into(),
    };
    loop {
        let at = r.at;
        let op = r.u8()?;
        let pop = |stack: &mut Vec<Item>| -> Result<Value, PickleError> {
            match stack.pop() {
                Some(Item::Value(v)) => Ok(v),
                _ => Err(malformed(at, "stack empty or at a mark")),
            }
        };
        let pop_mark = |stack: &mut Vec<Item>| -> Result<Vec<Value>, PickleError> {
            let mut items = Vec::new();
            loop {
                match stack.pop() {
                    Some(Item::Value(v)) => items.push(v),
                    Some(Item::Mark) => break,
                    None => return Err(malformed(at, "no mark")),
                }
            }
            items.reverse();
            Ok(items)
        };
        let global = |module: String, name: String| {
            if allowed(&module, &name) {
                Ok(Value::Global(module, name))
            } else {
                Err(PickleError::Forbidden(module, name))
            }
        };
        let value = match op {
            0x80 => {
                r.u8()?; // PROTO
                continue;
            }
            0x95 => {
                r.le(8)?; // FRAME
                continue;
            }
            b'.' => return pop(&mut stack),
            b'(' => {
                stack.push(Item::Mark);
                continue;
            }
            b'0' => {
                pop(&mut stack)?;
                continue;
            }
            b'1' => {
                pop_mark(&mut stack)?;
                continue;
            }
            b'N' => Value::None,
            0x88 => Value::Bool(true),
            0x89 => Value::Bool(false),
            b'J' => Value::Int(r.le(4)? as u32 as i32 as i64),
            b'K' => Value::Int(r.u8()? as i64),
            b'M' => Value::Int(r.le(2)? as i64),
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    r.u8()? as usize
                } else {
                    r.le(4)? as usize
                };
                let bytes = r.take(n)?;
                if n > 8 {
                    return Err(malformed(at, "an integer beyond 64 bits"));
                }
                let mut v = [if bytes.last().is_some_and(|b| b & 0x80 != 0) {
                    0xff
                } else {
                    0
                }; 8];
                v[..n].copy_from_slice(bytes);
                Value::Int(i64::from_le_bytes(v))
            }
            b'G' => {
                let mut v = [0u8; 8];
                v.copy_from_slice(r.take(8)?);
                Value::Float(f64::from_be_bytes(v))
            }
            0x8c => {
                let n = r.u8()? as usize;
                Value::Str(r.string(n)?)
            }
            b'X' => {
                let n = r.le(4)? as usize;
                Value::Str(r.string(n)?)
            }
            0x8d => {
                let n = r.le(8)? as usize;
                Value::Str(r.string(n)?)
            }
            b'U' => {
                let n = r.u8()? as usize;
                Value::Str(String::from_utf8_lossy(r.take(n)?).into_owned())
            }
            b'T' => {
                let n = r.le(4)? as usize;
                Value::Str(String::from_utf8_lossy(r.take(n)?).into_owned())
            }
            b'C' => {
                let n = r.u8()? as usize;
                Value::Bytes(r.take(n)?.to_vec())
            }
            b'B' => {
                let n = r.le(4)? as usize;
                Value::Bytes(r.take(n)?.to_vec())
            }
            0x8e => {
                let n = r.le(8)? as usize;
                Value::Bytes(r.take(n)?.to_vec())
            }
            b')' => Value::Tuple(Vec::new()),
            b't' => Value::Tuple(pop_mark(&mut stack)?),
            0x85 => Value::Tuple(vec![pop(&mut stack)?]),
            0x86 => {
                let b = pop(&mut stack)?;
                let a = pop(&mut stack)?;
                Value::Tuple(vec![a, b])
            }
            0x87 => {
                let c = pop(&mut stack)?;
                let b = pop(&mut stack)?;
                let a = pop(&mut stack)?;
                Value::Tuple(vec![a, b, c])
            }
            b']' => Value::List(Vec::new()),
            b'l' => Value::List(pop_mark(&mut stack)?),
            b'}' => Value::Dict(Vec::new()),
            b'd' => {
                let items = pop_mark(&mut stack)?;
                Value::Dict(pairs(items, at)?)
            }
            0x8f => Value::Set(Vec::new()),
            0x91 => Value::Set(pop_mark(&mut stack)?),
            b'a' | b'e' | b's' | b'u' | 0x90 => {
                let items = match op {
                    b'a' => vec![pop(&mut stack)?],
                    b's' => {
                        let v = pop(&mut stack)?;
                        let k = pop(&mut stack)?;
                        vec![k, v]
                    }
                    _ => pop_mark(&mut stack)?,
                };
                let target = match stack.last_mut() {
                    Some(Item::Value(v)) => v,
                    _ => return Err(malformed(at, "nothing to add to")),
                };
                match (op, target) {
                    (b'a' | b'e', Value::List(l)) => l.extend(items),
                    (b's' | b'u', Value::Dict(d)) => d.extend(pairs(items, at)?),
                    (0x90, Value::Set(s)) => s.extend(items),
                    _ => return Err(malformed(at, "adding to a value of another kind")),
                }
                continue;
            }
            b'c' => {
                let module = r.line()?;
                let name = r.line()?;
                global(module, name)?
            }
            0x93 => {
                let name = pop(&mut stack)?;
                let module = pop(&mut stack)?;
                match (module, name) {
                    (Value::Str(m), Value::Str(n)) => global(m, n)?,
                    _ => return Err(malformed(at, "STACK_GLOBAL of non-strings")),
                }
            }
            b'R' | 0x81 => {
                let args = pop(&mut stack)?;
                let callable = pop(&mut stack)?;
                let (Value::Global(m, n), Value::Tuple(args)) = (callable, args) else {
                    return Err(malformed(
                        at,
                        "a call of something that is not an allowed global",
                    ));
                };
                if (m.as_str(), n.as_str()) == ("collections", "OrderedDict") {
                    Value::Dict(Vec::new())
                } else {
                    Value::Object {
                        class: (m, n),
                        args,
                        state: None,
                    }
                }
            }
            b'b' => {
                let state = pop(&mut stack)?;
                match stack.last_mut() {
                    Some(Item::Value(Value::Object { state: s, .. })) => *s = Some(Box::new(state)),
                    Some(Item::Value(Value::Dict(d))) => {
                        if let Value::Dict(extra) = state {
                            d.extend(extra);
                        }
                    }
                    _ => return Err(malformed(at, "BUILD of a value that is not an object")),
                }
                continue;
            }
            b'Q' => Value::Persistent(Box::new(pop(&mut stack)?)),
            0x94 => {
                let v = match stack.last() {
                    Some(Item::Value(v)) => v.clone(),
                    _ => return Err(malformed(at, "MEMOIZE with nothing to keep")),
                };
                memo.insert(memo.len() as u64, v);
                continue;
            }
            b'q' | b'r' => {
                let key = if op == b'q' { r.u8()? as u64 } else { r.le(4)? };
                let v = match stack.last() {
                    Some(Item::Value(v)) => v.clone(),
                    _ => return Err(malformed(at, "PUT with nothing to keep")),
                };
                memo.insert(key, v);
                continue;
            }
            b'h' | b'j' => {
                let key = if op == b'h' { r.u8()? as u64 } else { r.le(4)? };
                memo.get(&key)
                    .cloned()
                    .ok_or_else(|| malformed(at, "GET of an unknown memo key"))?
            }
            _ => return Err(PickleError::Opcode { op, at }),
        };
        stack.push(Item::Value(value));
    }
}

fn pairs(items: Vec<Value>, at: usize) -> Result<Vec<(Value, Value)>, PickleError> {
    if !items.len().is_multiple_of(2) {
        return Err(PickleError::Malformed {
            at,
            what: "a dict with an odd number of items".into(),
        });
    }
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any(_: &str, _: &str) -> bool {
        true
    }

    #[test]
    fn decodes_protocol_two_and_four_data() {
        // pickle.dumps({"a": (1, -2, 3.5), "b": [True, None, b"x"], "c": "é"}, protocol=4)
        let p4 = b"\x80\x04\x952\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94K\x01J\xfe\xff\xff\xffG@\x0c\x00\x00\x00\x00\x00\x00\x87\x94\x8c\x01b\x94]\x94(\x88NC\x01x\x94e\x8c\x01c\x94\x8c\x02\xc3\xa9\x94u.";
        let v = load(p4, &any).unwrap();
        assert_eq!(
            v.get("a"),
            Some(&Value::Tuple(vec![
                Value::Int(1),
                Value::Int(-2),
                Value::Float(3.5)
            ]))
        );
        assert_eq!(
            v.get("b"),
            Some(&Value::List(vec![
                Value::Bool(true),
                Value::None,
                Value::Bytes(b"x".to_vec())
            ]))
        );
        assert_eq!(v.get("c"), Some(&Value::Str("é".into())));
    }

    #[test]
    fn globals_are_refused_unless_allowed_and_never_called() {
        // pickle.dumps(os.system) with protocol 2: a GLOBAL of `posix system`.
        let evil = b"\x80\x02cposix\nsystem\nq\x00.";
        let none = |_: &str, _: &str| false;
        assert_eq!(
            load(evil, &none).unwrap_err(),
            PickleError::Forbidden("posix".into(), "system".into())
        );
        // Even an allowed global called with REDUCE only becomes data.
        let call = b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00ls\x85R.";
        let v = load(call, &any).unwrap();
        assert!(matches!(v, Value::Object { ref class, .. } if class.1 == "system"));
        // Truncated and unknown opcodes are errors, not panics.
        assert!(matches!(
            load(&call[..10], &any),
            Err(PickleError::Truncated(_))
        ));
        assert!(matches!(
            load(b"\x80\x02i", &any),
            Err(PickleError::Opcode { op: b'i', .. })
        ));
    }
}
