// A gate in a stream: the work queued behind rf_hold waits until the host opens it.
//
// The kernel timer queues a whole step behind one rf_hold, then opens the gate, so the
// step's kernels run back to back as the device allows and the events between them
// time the kernels, not the host's launch pace.
//
// flag     page-locked host memory mapped into the device (its device pointer)
// target   rf_hold returns once *flag >= target
// max_naps polls before giving up (each after a few microseconds' sleep), so a host
//          that never opens the gate cannot hold the device forever
//
// Launch: grid (1), block (1).
#include "rf_portability.h"

RF_KERNEL void rf_hold(const volatile uint32_t* flag, uint32_t target, uint32_t max_naps) {
    rf_pdl_begin();
    for (uint32_t nap = 0; nap < max_naps && *flag < target; ++nap) {
        rf_sleep_briefly();
    }
}
