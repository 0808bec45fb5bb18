// Which NUMA node is closest to a PCI device (the GPU): where its pinned host memory and its
// optimizer threads belong. DeepSpeed users report H2D doubling once memory sat on the right
// node; this is the lookup that makes that automatic.
#pragma once

#include <string>

namespace strata {

// The NUMA node of the PCI device with bus id `pci_bus_id` ("0000:65:00.0"), found with hwloc
// and, where hwloc sees no PCI devices (some VMs), with sysfs. -1 if it cannot be told.
int numa_node_of_pci_device(const std::string& pci_bus_id);

}  // namespace strata
