//! `apply` and `delete`: manifests read and validated as a whole before anything is written.

use std::path::PathBuf;

use serde_json::Value;

use crate::exit::Exit;
use crate::manifest::{self, AnyObject};
use crate::resources::*;
use crate::store::{Key, Store, StoreSpec};

use super::{fail, kind_arg, open};

/// Reads and validates every manifest; any error means nothing is applied.
pub fn read_manifests(files: &[PathBuf]) -> Result<Vec<AnyObject>, Exit> {
    let mut objects = Vec::new();
    let mut errors = Vec::new();
    for path in files {
        let list = manifest::files(path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
        if list.is_empty() {
            return Err(fail(format!("{}: no .yaml, .yml or .json files", path.display())));
        }
        for file in list {
            let text = std::fs::read_to_string(&file).map_err(|e| fail(format!("{}: {e}", file.display())))?;
            match manifest::parse(&text, &file.display().to_string()) {
                Ok(objs) => objects.extend(objs),
                Err(errs) => errors.extend(errs),
            }
        }
    }
    if !errors.is_empty() {
        let lines: Vec<String> = errors.iter().map(|e| format!("error: {e}")).collect();
        return Err(Exit { message: format!("{}\nnothing was applied", lines.join("\n")), code: 1 });
    }
    Ok(objects)
}

pub(super) async fn apply(spec: &StoreSpec, files: &[PathBuf], force_replicas: bool) -> Result<(), Exit> {
    let mut objects = read_manifests(files)?;
    let store = open(spec).await?;
    objects.sort_by_key(|o| o.kind());
    for o in objects {
        let meta = o.meta();
        let mut desired = o.to_json();
        if !force_replicas {
            keep_autoscaled_replicas(&store, o.kind(), &mut desired).await?;
        }
        let (created, _) = store.apply(o.kind(), desired).await?;
        println!(
            "{}/{} {}",
            o.kind().as_str().to_ascii_lowercase(),
            meta.name,
            if created { "created" } else { "configured" }
        );
    }
    Ok(())
}

/// `replicas` has one owner at a time: on an autoscaled MachineDeployment or MachinePool that
/// exists, the stored size (the cluster-autoscaler's) is kept, brought within the manifest's
/// bounds, instead of the manifest's (like a Deployment's replicas under a HorizontalPodAutoscaler).
async fn keep_autoscaled_replicas(store: &Store, kind: Kind, desired: &mut Value) -> Result<(), Exit> {
    if !matches!(kind, Kind::MachineDeployment | Kind::MachinePool) {
        return Ok(());
    }
    let Some(bounds) = desired.pointer("/spec/autoscaling").cloned() else { return Ok(()) };
    let Ok(bounds) = serde_json::from_value::<crate::resources::Autoscaling>(bounds) else { return Ok(()) };
    let key = Key::new(
        kind,
        desired["metadata"]["namespace"].as_str().unwrap_or("default"),
        desired["metadata"]["name"].as_str().unwrap_or_default(),
    );
    let Some(stored) = store.backend().get(&key).await? else { return Ok(()) };
    let stored: Value = serde_json::from_str(&stored).map_err(|e| fail(format!("{key}: {e}")))?;
    if let Some(n) = stored.pointer("/spec/replicas").and_then(Value::as_i64) {
        desired["spec"]["replicas"] = Value::from(bounds.clamp(n));
    }
    Ok(())
}

pub(super) async fn delete(
    spec: &StoreSpec,
    kind: Option<String>,
    name: Option<String>,
    files: &[PathBuf],
    namespace: &str,
) -> Result<(), Exit> {
    let mut keys = Vec::new();
    if !files.is_empty() {
        for o in read_manifests(files)? {
            keys.push(Key::new(o.kind(), &o.meta().namespace, &o.meta().name));
        }
    }
    match (kind, name) {
        (Some(k), Some(n)) => keys.push(Key::new(kind_arg(&k)?, namespace, &n)),
        (Some(_), None) => return Err(fail("delete needs KIND NAME, or -f FILE")),
        _ if keys.is_empty() => return Err(fail("delete needs KIND NAME, or -f FILE")),
        _ => {}
    }
    let store = open(spec).await?;
    for key in keys.iter().rev() {
        let exists = store.backend().get(key).await?.is_some();
        if !exists {
            return Err(fail(format!("{} {} not found in namespace {}", key.kind, key.name, key.namespace)));
        }
        let left = store.delete(key).await?;
        let how = if left.is_some() {
            "deleting (waiting for the controller to remove it from the cloud)"
        } else {
            "deleted"
        };
        println!("{}/{} {how}", key.kind.as_str().to_ascii_lowercase(), key.name);
    }
    Ok(())
}
