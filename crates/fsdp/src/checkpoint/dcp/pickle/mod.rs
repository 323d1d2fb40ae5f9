//! A restricted pickle reader: it decodes protocols 2 to 5 into a tree of [`Value`]s and
//! executes nothing. A reference to a class or function (`GLOBAL`, `STACK_GLOBAL`) is
//! accepted only when the caller allows that name, and calls (`REDUCE`, `NEWOBJ`, `BUILD`)
//! are recorded as data, never run — what reading PyTorch's checkpoint metadata and tensor
//! records needs, and nothing an untrusted file could use.
//!
//! `value.rs` holds what it decodes to, `tree.rs` the arena it decodes into and the bounded
//! writing-out of that arena as a tree; `write.rs` writes the pickles a distributed
//! checkpoint of ours holds.

mod tree;
mod value;
mod write;

use std::collections::HashMap;

use tree::Node;
use value::malformed;
pub use value::{PickleError, Value};
pub use write::{Py, dump};

enum Item {
    Mark,
    Node(usize),
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

    fn len(&mut self, n: usize) -> Result<usize, PickleError> {
        usize::try_from(self.le(n)?).map_err(|_| PickleError::Truncated(self.at))
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

/// Decodes `data`, accepting only the globals `allowed` says yes to. The result is bounded
/// (see `tree.rs`): a small file cannot expand into a large tree.
pub fn load(data: &[u8], allowed: &dyn Fn(&str, &str) -> bool) -> Result<Value, PickleError> {
    let mut r = Reader { data, at: 0 };
    let mut nodes: Vec<Node> = Vec::new();
    let mut stack: Vec<Item> = Vec::new();
    let mut memo: HashMap<u64, usize> = HashMap::new();
    let root = loop {
        let at = r.at;
        let op = r.u8()?;
        let pop = |stack: &mut Vec<Item>| -> Result<usize, PickleError> {
            match stack.pop() {
                Some(Item::Node(n)) => Ok(n),
                _ => Err(malformed(at, "stack empty or at a mark")),
            }
        };
        let pop_mark = |stack: &mut Vec<Item>| -> Result<Vec<usize>, PickleError> {
            let mark = stack
                .iter()
                .rposition(|i| matches!(i, Item::Mark))
                .ok_or_else(|| malformed(at, "no mark"))?;
            let items = stack
                .drain(mark + 1..)
                .filter_map(|i| match i {
                    Item::Node(n) => Some(n),
                    Item::Mark => None,
                })
                .collect();
            stack.pop();
            Ok(items)
        };
        let global = |module: String, name: String| {
            if allowed(&module, &name) {
                Ok(Node::Leaf(Value::Global(module, name)))
            } else {
                Err(PickleError::Forbidden(module, name))
            }
        };
        let leaf = |v: Value| Node::Leaf(v);
        let node = match op {
            0x80 => {
                r.u8()?; // PROTO
                continue;
            }
            0x95 => {
                r.le(8)?; // FRAME
                continue;
            }
            b'.' => break pop(&mut stack)?,
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
            b'N' => leaf(Value::None),
            0x88 => leaf(Value::Bool(true)),
            0x89 => leaf(Value::Bool(false)),
            b'J' => leaf(Value::Int(r.le(4)? as u32 as i32 as i64)),
            b'K' => leaf(Value::Int(r.u8()? as i64)),
            b'M' => leaf(Value::Int(r.le(2)? as i64)),
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    r.u8()? as usize
                } else {
                    r.len(4)?
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
                leaf(Value::Int(i64::from_le_bytes(v)))
            }
            b'G' => {
                let mut v = [0u8; 8];
                v.copy_from_slice(r.take(8)?);
                leaf(Value::Float(f64::from_be_bytes(v)))
            }
            0x8c => {
                let n = r.u8()? as usize;
                leaf(Value::Str(r.string(n)?))
            }
            b'X' => {
                let n = r.len(4)?;
                leaf(Value::Str(r.string(n)?))
            }
            0x8d => {
                let n = r.len(8)?;
                leaf(Value::Str(r.string(n)?))
            }
            b'U' => {
                let n = r.u8()? as usize;
                leaf(Value::Str(String::from_utf8_lossy(r.take(n)?).into_owned()))
            }
            b'T' => {
                let n = r.len(4)?;
                leaf(Value::Str(String::from_utf8_lossy(r.take(n)?).into_owned()))
            }
            b'C' => {
                let n = r.u8()? as usize;
                leaf(Value::Bytes(r.take(n)?.to_vec()))
            }
            b'B' => {
                let n = r.len(4)?;
                leaf(Value::Bytes(r.take(n)?.to_vec()))
            }
            0x8e => {
                let n = r.len(8)?;
                leaf(Value::Bytes(r.take(n)?.to_vec()))
            }
            b')' => Node::Tuple(Vec::new()),
            b't' => Node::Tuple(pop_mark(&mut stack)?),
            0x85 => Node::Tuple(vec![pop(&mut stack)?]),
            0x86 => {
                let b = pop(&mut stack)?;
                let a = pop(&mut stack)?;
                Node::Tuple(vec![a, b])
            }
            0x87 => {
                let c = pop(&mut stack)?;
                let b = pop(&mut stack)?;
                let a = pop(&mut stack)?;
                Node::Tuple(vec![a, b, c])
            }
            b']' => Node::List(Vec::new()),
            b'l' => Node::List(pop_mark(&mut stack)?),
            b'}' => Node::Dict(Vec::new()),
            b'd' => Node::Dict(pairs(pop_mark(&mut stack)?, at)?),
            0x8f => Node::Set(Vec::new()),
            0x91 => Node::Set(pop_mark(&mut stack)?),
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
                let target = match stack.last() {
                    Some(Item::Node(n)) => *n,
                    _ => return Err(malformed(at, "nothing to add to")),
                };
                match (op, &mut nodes[target]) {
                    (b'a' | b'e', Node::List(l)) => l.extend(items),
                    (b's' | b'u', Node::Dict(d)) => d.extend(pairs(items, at)?),
                    (0x90, Node::Set(s)) => s.extend(items),
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
                match (&nodes[module], &nodes[name]) {
                    (Node::Leaf(Value::Str(m)), Node::Leaf(Value::Str(n))) => {
                        global(m.clone(), n.clone())?
                    }
                    _ => return Err(malformed(at, "STACK_GLOBAL of non-strings")),
                }
            }
            b'R' | 0x81 => {
                let args = pop(&mut stack)?;
                let callable = pop(&mut stack)?;
                let (Node::Leaf(Value::Global(m, n)), Node::Tuple(args)) =
                    (&nodes[callable], &nodes[args])
                else {
                    return Err(malformed(
                        at,
                        "a call of something that is not an allowed global",
                    ));
                };
                if (m.as_str(), n.as_str()) == ("collections", "OrderedDict") {
                    Node::Dict(Vec::new())
                } else {
                    Node::Object {
                        class: (m.clone(), n.clone()),
                        args: args.clone(),
                        state: None,
                    }
                }
            }
            b'b' => {
                let state = pop(&mut stack)?;
                let target = match stack.last() {
                    Some(Item::Node(n)) => *n,
                    _ => return Err(malformed(at, "BUILD of a value that is not an object")),
                };
                let extra = match &nodes[state] {
                    Node::Dict(d) => d.clone(),
                    _ => Vec::new(),
                };
                match &mut nodes[target] {
                    Node::Object { state: s, .. } => *s = Some(state),
                    Node::Dict(d) => d.extend(extra),
                    _ => return Err(malformed(at, "BUILD of a value that is not an object")),
                }
                continue;
            }
            b'Q' => Node::Persistent(pop(&mut stack)?),
            0x94 | b'q' | b'r' => {
                let key = match op {
                    0x94 => memo.len() as u64,
                    b'q' => r.u8()? as u64,
                    _ => r.le(4)?,
                };
                let n = match stack.last() {
                    Some(Item::Node(n)) => *n,
                    _ => return Err(malformed(at, "MEMOIZE or PUT with nothing to keep")),
                };
                memo.insert(key, n);
                continue;
            }
            b'h' | b'j' => {
                let key = if op == b'h' { r.u8()? as u64 } else { r.le(4)? };
                let n = *memo
                    .get(&key)
                    .ok_or_else(|| malformed(at, "GET of an unknown memo key"))?;
                stack.push(Item::Node(n));
                continue;
            }
            _ => return Err(PickleError::Opcode { op, at }),
        };
        nodes.push(node);
        stack.push(Item::Node(nodes.len() - 1));
    };
    tree::write_out(&nodes, root, data.len(), r.at)
}

fn pairs(items: Vec<usize>, at: usize) -> Result<Vec<(usize, usize)>, PickleError> {
    if !items.len().is_multiple_of(2) {
        return Err(PickleError::Malformed {
            at,
            what: "a dict with an odd number of items".into(),
        });
    }
    Ok(items.chunks_exact(2).map(|p| (p[0], p[1])).collect())
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

    #[test]
    fn shared_references_are_shared_and_filled_containers_seen_filled() {
        // pickle.dumps([x, x]) for x = [1, 2]: x is memoized empty, then filled, then got.
        let p = b"\x80\x04]\x94(]\x94(K\x01K\x02eh\x01e.";
        assert_eq!(
            load(p, &any).unwrap(),
            Value::List(vec![
                Value::List(vec![Value::Int(1), Value::Int(2)]),
                Value::List(vec![Value::Int(1), Value::Int(2)]),
            ])
        );
    }

    #[test]
    fn memo_bombs_deep_nesting_and_cycles_are_errors_within_bounds() {
        // A memo bomb: each level a list holding the previous level 16 times, 40 levels
        // (16^40 values if copied out; a few hundred bytes of input).
        let mut bomb = b"\x80\x04]\x94".to_vec();
        for level in 0..40u8 {
            bomb.push(b'(');
            for _ in 0..16 {
                bomb.extend_from_slice(&[b'h', level]);
            }
            bomb.extend_from_slice(b"l\x94");
        }
        bomb.push(b'.');
        assert!(bomb.len() < 1500);
        let started = std::time::Instant::now();
        let err = load(&bomb, &any).unwrap_err().to_string();
        assert!(err.contains("expands to more values"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        // 4 MB of nesting: refused, not a stack overflow.
        let mut deep = b"\x80\x04".to_vec();
        deep.extend(std::iter::repeat_n(b']', 4 << 20));
        deep.extend(std::iter::repeat_n(b'a', (4 << 20) - 1));
        deep.push(b'.');
        let err = load(&deep, &any).unwrap_err().to_string();
        assert!(err.contains("nested deeper"), "{err}");
        // A list that holds itself.
        let cycle = b"\x80\x04]\x94h\x00a.";
        let err = load(cycle, &any).unwrap_err().to_string();
        assert!(err.contains("refers to itself"), "{err}");
        // Lengths past the input are truncation, not allocation.
        let huge = b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x7f";
        assert!(matches!(load(huge, &any), Err(PickleError::Truncated(_))));
    }
}
