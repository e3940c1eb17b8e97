use super::*;
use crate::resources::{Kind, Machine, MachineClass, MachineDeployment, MachineHealthCheck, MachinePool};

fn round_trip(text: &str) {
    let packed = Packed::new(text);
    assert_eq!(&*packed.text().unwrap(), text);
    assert_eq!(packed.read(str::to_string).unwrap(), text);
}

#[test]
fn every_text_reads_back_exactly() {
    round_trip("");
    round_trip("{}");
    round_trip("{\"metadata\":{\"name\":\"ünïcödé ✓\"}}");
    for line in DICTIONARY.lines() {
        round_trip(line);
        // An object the dictionary does not resemble still reads back.
        round_trip(&line.replace("metadata", "metadatum").replace('"', "'"));
    }
    // Larger than the buffer a thread keeps between reads.
    round_trip(&"x".repeat(3 * BUFFER_KEPT));
}

#[test]
fn a_read_may_unpack_another_object() {
    let (a, b) = (Packed::new("{\"a\":1}"), Packed::new("{\"b\":2}"));
    let both = a.read(|a| format!("{a}{}", b.read(str::to_string).unwrap())).unwrap();
    assert_eq!(both, "{\"a\":1}{\"b\":2}");
}

/// The dictionary holds one stored object of each kind, as this build writes them: if a field is
/// renamed, its line no longer parses as the kind (or prints differently) and this fails, so the
/// dictionary is made again (see `packed/README.md`) rather than silently compressing worse.
#[test]
fn the_dictionary_holds_objects_as_this_build_stores_them() {
    fn reprinted<T: crate::resources::Resource>(line: &str) -> serde_json::Value {
        let typed: T = serde_json::from_str(line).unwrap_or_else(|e| panic!("{}: {e}\n{line}", T::KIND));
        serde_json::to_value(&typed).unwrap()
    }
    let mut kinds = Vec::new();
    for line in DICTIONARY.lines() {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        let kind = Kind::from_name(value["kind"].as_str().unwrap()).unwrap();
        let again = match kind {
            Kind::Machine => reprinted::<Machine>(line),
            Kind::MachineDeployment => reprinted::<MachineDeployment>(line),
            Kind::MachineClass => reprinted::<MachineClass>(line),
            Kind::MachinePool => reprinted::<MachinePool>(line),
            Kind::MachineHealthCheck => reprinted::<MachineHealthCheck>(line),
            Kind::Secret => panic!("the dictionary holds no Secret: it would carry secret data"),
        };
        assert_eq!(again, value, "{kind} prints differently now");
        kinds.push(kind);
    }
    for kind in [Kind::Machine, Kind::MachineDeployment, Kind::MachineClass, Kind::MachinePool] {
        assert!(kinds.contains(&kind), "no {kind} in the dictionary");
    }
}

/// What the cache saves: a Running Machine of a deployment (the dictionary's own line, with every
/// value that is its own changed) takes under a third of its text.
#[test]
fn a_running_machine_packs_to_under_a_third() {
    let machine = DICTIONARY
        .lines()
        .find(|l| l.contains("\"kind\":\"Machine\"") && l.contains("\"phase\":\"Running\""))
        .expect("a Running Machine in the dictionary");
    let mut other: Machine = serde_json::from_str(machine).unwrap();
    other.metadata.name = "other-7f3c9-k2x8q".into();
    other.metadata.uid = uuid::Uuid::new_v4().to_string();
    other.status.provider_id = "fake:///zone-b/other-7f3c9-k2x8q".into();
    other.status.request_ids = (0..3).map(|_| uuid::Uuid::new_v4().to_string()).collect();
    let text = serde_json::to_string(&serde_json::to_value(&other).unwrap()).unwrap();
    let packed = Packed::new(&text);
    assert!(packed.packed_len() * 3 < text.len(), "{} bytes packed to {}", text.len(), packed.packed_len());
    assert_eq!(&*packed.text().unwrap(), text);
}
