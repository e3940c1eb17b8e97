use super::*;

fn domains(weights: &[u32]) -> Vec<FailureDomain> {
    weights
        .iter()
        .enumerate()
        .map(|(i, w)| FailureDomain { name: format!("z{i}"), provider_spec: None, weight: *w, priority: 0 })
        .collect()
}

#[test]
fn shares_split_replicas_by_weight_over_the_open_domains() {
    let d = domains(&[1, 1, 1]);
    let s = Spread::new(&d, std::iter::empty(), "r", vec![true, true, true]);
    assert_eq!(s.shares(10), [4, 3, 3]);
    let s = Spread::new(&d, std::iter::empty(), "r", vec![true, false, true]);
    assert_eq!(s.shares(9), [5, 0, 4]);
    let d = domains(&[2, 1]);
    let s = Spread::new(&d, std::iter::empty(), "r", vec![true, true]);
    assert_eq!(s.shares(7), [5, 2]);
    let s = Spread::new(&d, std::iter::empty(), "r", vec![false, false]);
    assert_eq!(s.shares(7), [0, 0]);
}

#[test]
fn place_fills_the_least_populated_open_domain() {
    let d = domains(&[1, 1, 1]);
    let mut s = Spread::new(&d, std::iter::empty(), "r", vec![true, false, true]);
    let got: Vec<String> = (0..4).filter_map(|_| s.place().map(|d| d.name.clone())).collect();
    assert_eq!(got, ["z0", "z2", "z0", "z2"]);
    let mut s = Spread::new(&d, std::iter::empty(), "r", vec![false, false, false]);
    assert!(s.place().is_none());
}

#[test]
fn backoff_doubles_up_to_the_maximum() {
    let b = FailureDomainBackoff { initial_seconds: 10, max_seconds: 35 };
    let mut st = FailureDomainStatus::default();
    let now = chrono::Utc::now();
    let got: Vec<u64> = (0..4).map(|_| mark(&mut st, &b, now, "InsufficientCapacity", "no room")).collect();
    assert_eq!(got, [10, 20, 35, 35]);
    assert_eq!(st.unavailable_until, Some(now + chrono::Duration::seconds(35)));
}

#[test]
fn only_the_open_domains_of_the_highest_priority_take_machines() {
    let mut d = domains(&[1, 1, 1]);
    d[0].priority = 1;
    d[1].priority = 1;
    let mut s = Spread::new(&d, std::iter::empty(), "r", vec![true, true, true]);
    let got: Vec<String> = (0..3).filter_map(|_| s.place().map(|d| d.name.clone())).collect();
    assert_eq!(got, ["z0", "z1", "z0"]);
    assert_eq!(s.shares(4), [2, 2, 0]);
    // The preferred domains closed: the fallback takes them all.
    let mut s = Spread::new(&d, std::iter::empty(), "r", vec![false, false, true]);
    assert_eq!(s.place().map(|d| d.name.as_str()), Some("z2"));
    assert_eq!(s.shares(4), [0, 0, 4]);
    // Machines in the fallback move back to the preferred, open domain.
    let s = Spread::from_counts(&d, vec![1, 0, 2], vec![true, false, true]);
    assert_eq!(s.imbalance(0, 1).map(|(f, t)| (f.map(|f| f.name.as_str()), t.name.as_str())), Some((Some("z2"), "z0")));
    // Removals take the fallback's first, even when a preferred domain is fuller.
    let s = Spread::from_counts(&d, vec![3, 0, 1], vec![true, true, true]);
    let ms = ["z0", "z0", "z2", "z0"];
    let order = s.order(ms.iter().collect(), |m: &&str| Some(*m), |_| false);
    assert_eq!(order[0], &"z2");
}
