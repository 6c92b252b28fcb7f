//! Clusters of real broker processes on the in-memory, fault-injecting
//! disk served over FUSE ([`ferrolog_jepsen::disk`], where the disk lives
//! so that jepsen's `power` fault uses it too).

pub use ferrolog_jepsen::disk::FuseDisk;

/// A cluster whose every broker runs on its own [`FuseDisk`]. Dropping it
/// kills the brokers first, then unmounts the disks, then removes the
/// cluster's directory (a disk unmounted under a running broker would
/// leave it writing into the empty directory beneath).
#[derive(Debug)]
pub struct DiskCluster {
    /// The disks, index = broker id - 1 (dropped before `cluster`).
    pub disks: Vec<FuseDisk>,
    /// The brokers, not started.
    pub cluster: crate::Cluster,
}

impl DiskCluster {
    /// As [`crate::Cluster::prepare`], with a fresh disk mounted at each
    /// broker's data directory (seeded by the broker id).
    ///
    /// # Errors
    /// As [`crate::Cluster::prepare`] and [`FuseDisk::mount`].
    pub fn prepare(name: &str, binary: &str, n: u32, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let cluster = crate::Cluster::prepare(name, binary, n, env)?;
        let mut disks = Vec::new();
        for id in 1..=n {
            disks.push(FuseDisk::mount(cluster.data_dir(id), u64::from(id))?);
        }
        Ok(Self { disks, cluster })
    }
}

impl Drop for DiskCluster {
    fn drop(&mut self) {
        for id in 1..=self.cluster.size() {
            self.cluster.kill(id);
        }
    }
}
