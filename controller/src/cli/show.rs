//! `get` and `describe`: tables, YAML/JSON and the describe view, with Secrets' values redacted.

use std::io::Write;

use serde_json::Value;

use crate::exit::Exit;
use crate::resources::*;
use crate::store::{Key, Store};

use super::{fail, Output};

fn age(t: Option<Time>) -> String {
    let Some(t) = t else { return "-".into() };
    let s = (chrono::Utc::now() - t).num_seconds().max(0);
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        7200..=172_799 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

/// `v` with the values of its kind's secret fields replaced by `<redacted>` (a Secret's `data`
/// and `stringData`: [`Shape::secret_fields`](crate::resources::Shape::secret_fields)).
fn redact(kind: Kind, mut v: Value) -> Value {
    for field in kind.shape().secret_fields() {
        if let Some(Value::Object(m)) = v.get_mut(*field) {
            for val in m.values_mut() {
                *val = Value::String("<redacted>".into());
            }
        }
    }
    v
}

fn print_table(rows: Vec<Vec<String>>) {
    let widths: Vec<usize> =
        (0..rows.first().map_or(0, Vec::len)).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
    let mut out = std::io::stdout().lock();
    for r in rows {
        let line: Vec<String> = r.iter().enumerate().map(|(i, c)| format!("{c:<w$}", w = widths[i])).collect();
        let _ = writeln!(out, "{}", line.join("   ").trim_end());
    }
}

/// The stored object as JSON. One that does not parse (a store file edited by hand, a damaged
/// restore) is an error that names it: `get` and `describe` never pass over it in silence.
fn stored_json(key: &Key, json: &str) -> Result<Value, String> {
    serde_json::from_str(json).map_err(|source| {
        machine_driver_util::error_chain(&crate::store::Error::Unreadable { key: key.clone(), source })
    })
}

pub(super) async fn get(
    store: &Store,
    kind: Kind,
    name: Option<&str>,
    namespace: &str,
    output: Output,
) -> Result<(), Exit> {
    // By key, so an object whose text does not parse is still found, and named.
    let keys = store.keys(kind).await?;
    let mut raw: Vec<Value> = Vec::new();
    let mut unreadable: Vec<String> = Vec::new();
    for key in keys.iter().filter(|k| k.namespace == namespace && name.is_none_or(|n| k.name == n)) {
        let Some(json) = store.backend().get(key).await? else { continue };
        match stored_json(key, &json) {
            Ok(v) => raw.push(v),
            Err(e) => unreadable.push(e),
        }
    }
    if !unreadable.is_empty() {
        // The readable ones are still shown; the exit code says the list is not whole.
        let shown = raw.len();
        if shown > 0 {
            show(kind, name, namespace, output, raw)?;
        }
        return Err(fail(format!(
            "{} of {} {kind} objects could not be read:\n  {}",
            unreadable.len(),
            unreadable.len() + shown,
            unreadable.join("\n  ")
        )));
    }
    if let Some(n) = name {
        if raw.is_empty() {
            return Err(fail(format!("{kind} {n} not found in namespace {namespace}")));
        }
    }
    show(kind, name, namespace, output, raw)
}

/// Prints `get`'s objects in `output`'s format.
fn show(kind: Kind, name: Option<&str>, namespace: &str, output: Output, mut raw: Vec<Value>) -> Result<(), Exit> {
    raw = raw.into_iter().map(|v| redact(kind, v)).collect();
    match output {
        Output::Json => {
            let v = if name.is_some() {
                raw.remove(0)
            } else {
                serde_json::json!({"apiVersion": "v1", "kind": "List", "items": raw})
            };
            println!("{}", serde_json::to_string_pretty(&v)?);
            return Ok(());
        }
        Output::Yaml => {
            let v = if name.is_some() {
                raw.remove(0)
            } else {
                serde_json::json!({"apiVersion": "v1", "kind": "List", "items": raw})
            };
            print!("{}", serde_saphyr::to_string(&v).map_err(|e| fail(e.to_string()))?);
            return Ok(());
        }
        Output::Table | Output::Wide => {}
    }
    let wide = output == Output::Wide;
    if raw.is_empty() {
        eprintln!("no {kind} objects in namespace {namespace}");
        return Ok(());
    }
    print_table(table(kind, raw, wide)?);
    Ok(())
}

/// The rows of `get`'s table: a header (NAME, then the kind's [`Column`]s in capitals, the wide
/// ones after the others), then one row per object.
pub(super) fn table(kind: Kind, raw: Vec<Value>, wide: bool) -> Result<Vec<Vec<String>>, Exit> {
    let columns = kind.columns().iter().filter(|c| c.in_table(wide) && !c.is_wide());
    let columns: Vec<&Column> =
        columns.chain(kind.columns().iter().filter(|c| c.in_table(wide) && c.is_wide())).collect();
    let mut rows =
        vec![std::iter::once("NAME".to_string()).chain(columns.iter().map(|c| c.name.to_uppercase())).collect()];
    for v in raw {
        let v = kind.normalize(v)?;
        let mut row = vec![v["metadata"]["name"].as_str().unwrap_or("").to_string()];
        row.extend(columns.iter().map(|c| cell(c, &v)));
        rows.push(row);
    }
    Ok(rows)
}

/// One cell of `get`'s table.
fn cell(column: &Column, object: &Value) -> String {
    if let Some(f) = column.cell {
        return f(object);
    }
    let value = column.lookup(object).filter(|v| !v.is_null());
    match (column.ty, value) {
        (ColumnType::Date, v) => age(v
            .and_then(Value::as_str)
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&chrono::Utc))),
        (ColumnType::Integer, None) => "0".into(),
        (_, None) => "-".into(),
        (_, Some(Value::String(s))) => or_dash(s),
        (_, Some(v)) => v.to_string(),
    }
}

fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.into()
    }
}

pub(super) async fn describe(store: &Store, kind: Kind, name: &str, namespace: &str) -> Result<(), Exit> {
    let key = Key::new(kind, namespace, name);
    let Some(json) = store.backend().get(&key).await? else {
        return Err(fail(format!("{kind} {name} not found in namespace {namespace}")));
    };
    let v = redact(kind, stored_json(&key, &json).map_err(fail)?);
    let mut out = String::new();
    let meta = &v["metadata"];
    out += &format!("Name:         {}\nNamespace:    {}\nKind:         {}\n", name, namespace, kind);
    out += &format!("Created:      {}\n", meta["creationTimestamp"].as_str().unwrap_or("-"));
    if let Some(d) = meta["deletionTimestamp"].as_str() {
        out += &format!("Deleting:     since {d}\n");
    }
    out += &format!(
        "Generation:   {}\nVersion:      {}\n",
        meta["generation"],
        meta["resourceVersion"].as_str().unwrap_or("-")
    );
    for (title, field) in [("Labels", "labels"), ("Annotations", "annotations")] {
        if let Some(o) = meta[field].as_object() {
            out += &format!("{title}:\n");
            for (k, val) in o {
                out += &format!("  {k}={}\n", val.as_str().unwrap_or(""));
            }
        }
    }
    if let Some(f) = meta["finalizers"].as_array() {
        out += &format!("Finalizers:   {}\n", f.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", "));
    }
    if let Some(spec) = v.get("spec") {
        out += "Spec:\n";
        out += &indent(&serde_saphyr::to_string(spec).unwrap_or_default());
    }
    let status = &v["status"];
    if let Some(phase) = status["phase"].as_str() {
        out += &format!("Phase:        {phase}\n");
    }
    if let Some(p) = status["providerId"].as_str() {
        out += &format!("Provider ID:  {p}\n");
    }
    let (head, tail) = kind.describe(status);
    out += &head;
    if let Some(a) = status["addresses"].as_array() {
        for addr in a {
            out += &format!(
                "Address:      {} {}\n",
                addr["type"].as_str().unwrap_or(""),
                addr["address"].as_str().unwrap_or("")
            );
        }
    }
    if let Some(conds) = status["conditions"].as_array() {
        out += "Conditions:\n  TYPE                    STATUS  REASON                        MESSAGE\n";
        for c in conds {
            out += &format!(
                "  {:<23} {:<7} {:<29} {}\n",
                c["type"].as_str().unwrap_or(""),
                c["status"].as_str().unwrap_or(""),
                c["reason"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or("")
            );
        }
    }
    if let Some(ops) = status["operations"].as_array() {
        out += "Operations in flight:\n";
        for o in ops {
            out += &format!(
                "  {} {} started {} ({}% done), request {}\n",
                o["kind"].as_str().unwrap_or(""),
                o["name"].as_str().unwrap_or(""),
                o["started"].as_str().unwrap_or(""),
                o["progress"],
                o["requestId"].as_str().unwrap_or("")
            );
        }
    }
    if let Some(l) = status.get("lastOperation").filter(|l| !l.is_null()) {
        out += &format!(
            "Last operation: {} {} code={} {} request={} at {}\n",
            l["type"].as_str().unwrap_or(""),
            l["state"].as_str().unwrap_or(""),
            l["code"].as_str().unwrap_or(""),
            l["reason"].as_str().map(|r| format!("reason={r}")).unwrap_or_default(),
            l["requestId"].as_str().unwrap_or(""),
            l["time"].as_str().unwrap_or("")
        );
        if let Some(m) = l["message"].as_str() {
            out += &format!("  message: {m}\n");
        }
    }
    if let Some(ids) = status["requestIds"].as_array() {
        out +=
            &format!("Recent request IDs: {}\n", ids.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", "));
    }
    if let Some(f) = status.get("failure").filter(|f| !f.is_null()) {
        out += &format!(
            "Exit:      {} {}: {}\n",
            f["code"].as_str().unwrap_or(""),
            f["reason"].as_str().unwrap_or(""),
            f["message"].as_str().unwrap_or("")
        );
    }
    out += &tail;
    let events = store.backend().events(&key, 15).await?;
    out += "Events:\n";
    if events.is_empty() {
        out += "  <none>\n";
    }
    for e in events {
        out += &format!("  {}  {:<7} {:<22} {}\n", e.time.format("%H:%M:%S%.3f"), e.event_type, e.reason, e.message);
    }
    print!("{out}");
    Ok(())
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}\n")).collect()
}
