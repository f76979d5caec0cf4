// A Go caller of the TENT C API through cgo: two engines, a WRITE and a READ back from Go-heap
// request slices, a notification, every byte verified. Exits non-zero on any failure.
package main

/*
#cgo CFLAGS: -I${SRCDIR}/../../include
#cgo LDFLAGS: -ltent
#include <stdlib.h>
#include "tent/transfer_engine.h"
*/
import "C"

import (
	"fmt"
	"os"
	"unsafe"
)

const size = 4 << 20

func fail(format string, args ...interface{}) {
	msg := make([]byte, 512)
	C.tent_last_error((*C.char)(unsafe.Pointer(&msg[0])), C.size_t(len(msg)))
	fmt.Fprintf(os.Stderr, "go tent: "+format+" (last error: %s)\n",
		append(args, C.GoString((*C.char)(unsafe.Pointer(&msg[0]))))...)
	os.Exit(1)
}

func check(ret C.int, what string) {
	if ret != 0 {
		fail("%s = %d", what, int(ret))
	}
}

func run(engine C.tent_engine_t, opcode int, local unsafe.Pointer, seg C.tent_segment_id_t, remote unsafe.Pointer) {
	batch := C.tent_allocate_batch(engine, 1)
	if batch == 0 || batch == C.UINT64_MAX {
		fail("tent_allocate_batch")
	}
	requests := make([]C.tent_request_t, 1) // zeroed: transport_hint is TRANSPORT_UNSPEC
	requests[0].opcode = C.int(opcode)
	requests[0].source = local
	requests[0].target_id = seg
	requests[0].target_offset = C.uint64_t(uintptr(remote))
	requests[0].length = size
	check(C.tent_submit(engine, batch, &requests[0], 1), "tent_submit")
	requests[0].length = 0 // copied by the library
	var st C.tent_status_t
	for {
		check(C.tent_task_status(engine, batch, 0, &st), "tent_task_status")
		if st.status != C.STATUS_WAITING && st.status != C.STATUS_PENDING {
			break
		}
	}
	if st.status != C.STATUS_COMPLETED {
		fail("task ended with status %d", int(st.status))
	}
	check(C.tent_free_batch(engine, batch), "tent_free_batch")
}

func main() {
	key, value := C.CString("rpc_server_hostname"), C.CString("127.0.0.1")
	C.tent_set_config(key, value)
	C.free(unsafe.Pointer(key))
	C.free(unsafe.Pointer(value))
	a, b := C.tent_create_engine(), C.tent_create_engine()
	if C.tent_available(a) != 1 || C.tent_available(b) != 1 {
		fail("engines did not start")
	}

	src, back, target := C.malloc(size), C.malloc(size), C.malloc(size)
	srcBytes := unsafe.Slice((*byte)(src), size)
	backBytes := unsafe.Slice((*byte)(back), size)
	targetBytes := unsafe.Slice((*byte)(target), size)
	for i := range srcBytes {
		srcBytes[i], backBytes[i], targetBytes[i] = byte(i*11+1), 0, 0
	}
	check(C.tent_register_memory(a, src, size), "tent_register_memory(src)")
	check(C.tent_register_memory(a, back, size), "tent_register_memory(back)")
	check(C.tent_register_memory(b, target, size), "tent_register_memory(target)")

	name := make([]byte, 256)
	check(C.tent_segment_name(b, (*C.char)(unsafe.Pointer(&name[0])), C.size_t(len(name))), "tent_segment_name")
	var seg C.tent_segment_id_t
	check(C.tent_open_segment(a, &seg, (*C.char)(unsafe.Pointer(&name[0]))), "tent_open_segment")

	run(a, C.OPCODE_WRITE, src, seg, target)
	for i := range srcBytes {
		if targetBytes[i] != srcBytes[i] {
			fail("WRITE: byte %d differs", i)
		}
	}
	run(a, C.OPCODE_READ, back, seg, target)
	for i := range srcBytes {
		if backBytes[i] != srcBytes[i] {
			fail("READ: byte %d differs", i)
		}
	}

	n, m := C.CString("go"), C.CString("done")
	check(C.tent_send_notifs(a, seg, n, m), "tent_send_notifs")
	C.free(unsafe.Pointer(n))
	C.free(unsafe.Pointer(m))
	got := false
	for spin := 0; spin < 10000000 && !got; spin++ {
		var info C.struct_tent_notifi_info
		check(C.tent_recv_notifs(b, &info), "tent_recv_notifs")
		if info.num_records > 0 {
			rec := unsafe.Slice(info.records, int(info.num_records))
			got = C.GoString(&rec[0].name[0]) == "go" && C.GoString(&rec[0].msg[0]) == "done"
		}
		C.tent_free_notifs(&info)
	}
	if !got {
		fail("notification not received")
	}

	check(C.tent_unregister_memory(a, src, size), "tent_unregister_memory")
	check(C.tent_unregister_memory(a, back, size), "tent_unregister_memory")
	check(C.tent_unregister_memory(b, target, size), "tent_unregister_memory")
	C.tent_destroy_engine(a)
	C.tent_destroy_engine(b)
	C.free(src)
	C.free(back)
	C.free(target)
	fmt.Println("go tent: 4 MiB written and read back over TCP, notification received, ok")
}
