//! Provider IDs as compared between a Machine and its Node.
//!
//! The driver reports a machine's provider ID; the kubelet or cloud-controller-manager writes
//! the Node's `spec.providerID`. They name the same VM but not always in the same spelling:
//! cloud-provider-azure lower-cases the resource group (kubernetes #71994, CAPZ #1585), and ARM
//! resource IDs are case-insensitive as a whole. Both sides are compared in [`normalize`]d form.

/// The form two provider IDs are compared in: the scheme lower-cased and trailing slashes
/// dropped; for `azure://`, the whole ID lower-cased (ARM IDs are case-insensitive). Empty for
/// an empty ID.
pub fn normalize(id: &str) -> String {
    let id = id.trim();
    match id.split_once("://") {
        Some((scheme, rest)) => {
            let scheme = scheme.to_ascii_lowercase();
            let rest = rest.trim_end_matches('/');
            if scheme == "azure" {
                format!("azure://{}", rest.to_ascii_lowercase())
            } else {
                format!("{scheme}://{rest}")
            }
        }
        None => id.trim_end_matches('/').to_string(),
    }
}

/// Whether two provider IDs name the same machine.
pub fn same(a: &str, b: &str) -> bool {
    !a.trim().is_empty() && normalize(a) == normalize(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_ids_match_the_way_the_clouds_write_them_on_nodes() {
        let cases = [
            // (driver's, node's, same?)
            ("fake:///zone-a/0a1b", "fake:///zone-a/0a1b", true),
            ("fake:///zone-a/0a1b", "fake:///zone-a/0a1c", false),
            ("aws:///us-east-1a/i-0123456789abcdef0", "aws:///us-east-1a/i-0123456789abcdef0", true),
            ("AWS:///us-east-1a/i-0123", "aws:///us-east-1a/i-0123/", true),
            // AWS instance IDs are case-sensitive outside the scheme.
            ("aws:///us-east-1a/i-0123ABC", "aws:///us-east-1a/i-0123abc", false),
            // cloud-provider-azure lower-cases the resource group; ARM IDs ignore case.
            (
                "azure:///subscriptions/0000-AB/resourceGroups/My-RG/providers/Microsoft.Compute/virtualMachines/web-1",
                "azure:///subscriptions/0000-ab/resourcegroups/my-rg/providers/Microsoft.Compute/virtualMachines/web-1",
                true,
            ),
            (
                "azure:///subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/ss/virtualMachines/3",
                "azure:///subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/ss/virtualMachines/4",
                false,
            ),
            // A different scale set with the same instance number is another VM (CAPZ #1503).
            (
                "azure:///subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/a/virtualMachines/3",
                "azure:///subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/b/virtualMachines/3",
                false,
            ),
            ("", "", false),
        ];
        for (a, b, want) in cases {
            assert_eq!(same(a, b), want, "{a} vs {b}");
            assert_eq!(same(b, a), want, "{b} vs {a}");
        }
    }
}
