// A Go caller of the classic C API through cgo, used the way Mooncake's Go p2p-store uses it:
// P2PHANDSHAKE engines, installTransport("tcp") with a {NULL} args array from the Go heap,
// registerLocalMemory from many goroutines at once, request slices on the Go heap passed to
// submitTransfer (and scribbled over right after, so the library must have copied them), busy
// polling of getTransferStatus, freeBatchID, unregister and destroy. Two engines; every byte is
// verified. Exits non-zero on any failure.
package main

/*
#cgo CFLAGS: -I${SRCDIR}/../../include
#cgo LDFLAGS: -ltent
#include <stdlib.h>
#include "transfer_engine_c.h"
*/
import "C"

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"unsafe"
)

const (
	chunks    = 16
	chunkSize = 256 << 10
	total     = chunks * chunkSize
)

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "go classic: "+format+"\n", args...)
	os.Exit(1)
}

// newEngine creates an engine and installs TCP as the p2p-store does without a NIC matrix.
func newEngine() C.transfer_engine_t {
	conn := C.CString("P2PHANDSHAKE")
	name := C.CString("127.0.0.1:12345")
	host := C.CString("127.0.0.1")
	defer C.free(unsafe.Pointer(conn))
	defer C.free(unsafe.Pointer(name))
	defer C.free(unsafe.Pointer(host))
	engine := C.createTransferEngine(conn, name, host, 0, 0)
	if engine == nil {
		fail("createTransferEngine returned NULL")
	}
	proto := C.CString("tcp")
	defer C.free(unsafe.Pointer(proto))
	var args [2]unsafe.Pointer // {NULL, NULL} on the Go heap
	if C.installTransport(engine, proto, &args[0]) == nil {
		fail("installTransport(tcp) returned NULL")
	}
	return engine
}

// registerAll registers every chunk of buf from its own goroutine, all at once.
func registerAll(engine C.transfer_engine_t, buf unsafe.Pointer) {
	location := C.CString("cpu:0")
	defer C.free(unsafe.Pointer(location))
	var wg sync.WaitGroup
	errs := make(chan string, chunks)
	for i := 0; i < chunks; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			addr := unsafe.Add(buf, i*chunkSize)
			if ret := C.registerLocalMemory(engine, addr, chunkSize, location, 1); ret < 0 {
				errs <- fmt.Sprintf("registerLocalMemory chunk %d: %d", i, int(ret))
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		fail("%s", e)
	}
}

func unregisterAll(engine C.transfer_engine_t, buf unsafe.Pointer) {
	var wg sync.WaitGroup
	var failed sync.Map
	for i := 0; i < chunks; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			addr := unsafe.Add(buf, i*chunkSize)
			if ret := C.unregisterLocalMemory(engine, addr); ret < 0 {
				failed.Store(i, int(ret))
			}
		}(i)
	}
	wg.Wait()
	failed.Range(func(k, v interface{}) bool { fail("unregisterLocalMemory chunk %v: %v", k, v); return false })
}

// transfer moves one chunk with its own batch, as the p2p-store's transfer loop does: open the
// segment (without the cache on retries), submit one request from a Go-heap slice, busy-poll.
func transfer(engine C.transfer_engine_t, peer string, opcode int, local, remote unsafe.Pointer) error {
	batch := C.allocateBatchID(engine, 1)
	if batch == C.INVALID_BATCH {
		return fmt.Errorf("allocateBatchID failed")
	}
	defer C.freeBatchID(engine, batch)
	name := C.CString(peer)
	defer C.free(unsafe.Pointer(name))
	var seg C.segment_id_t
	for attempt := 0; ; attempt++ {
		if attempt == 0 {
			seg = C.openSegment(engine, name)
		} else {
			seg = C.openSegmentNoCache(engine, name)
		}
		if seg >= 0 {
			break
		}
		if attempt == 3 {
			return fmt.Errorf("openSegment(%s) = %d", peer, int(seg))
		}
	}
	requests := make([]C.transfer_request_t, 1)
	requests[0] = C.transfer_request_t{
		opcode:        C.int(opcode),
		source:        local,
		target_id:     seg,
		target_offset: C.uint64_t(uintptr(remote)), // the absolute remote address
		length:        chunkSize,
	}
	if ret := C.submitTransfer(engine, batch, &requests[0], C.size_t(len(requests))); ret != 0 {
		return fmt.Errorf("submitTransfer = %d", int(ret))
	}
	// The library copied the requests: what is in the slice now must not matter.
	requests[0] = C.transfer_request_t{opcode: 99, target_id: -7, length: 1 << 40}
	var status C.transfer_status_t
	for {
		if ret := C.getTransferStatus(engine, batch, 0, &status); ret != 0 {
			return fmt.Errorf("getTransferStatus = %d", int(ret))
		}
		if status.status != C.STATUS_WAITING && status.status != C.STATUS_PENDING {
			break
		}
	}
	if status.status != C.STATUS_COMPLETED {
		return fmt.Errorf("transfer ended with status %d", int(status.status))
	}
	if status.transferred_bytes != chunkSize {
		return fmt.Errorf("transferred %d bytes, want %d", uint64(status.transferred_bytes), chunkSize)
	}
	return nil
}

// parallel runs f for every chunk from several goroutines and fails on the first error.
func parallel(f func(i int) error) {
	var wg sync.WaitGroup
	errs := make(chan error, chunks)
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; i < chunks; i += 4 {
				if err := f(i); err != nil {
					errs <- fmt.Errorf("chunk %d: %v", i, err)
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		fail("%v", e)
	}
}

func main() {
	a, b := newEngine(), newEngine()

	buf := make([]byte, 256)
	if ret := C.getLocalIpAndPort(b, (*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf))); ret < 0 {
		fail("getLocalIpAndPort = %d", int(ret))
	}
	peer := C.GoString((*C.char)(unsafe.Pointer(&buf[0])))
	if !strings.HasPrefix(peer, "127.0.0.1:") {
		fail("getLocalIpAndPort gave %q", peer)
	}

	// Registered memory comes from C: the engine reads and writes it after calls return.
	src := C.malloc(total)
	back := C.malloc(total)
	target := C.malloc(total)
	srcBytes := unsafe.Slice((*byte)(src), total)
	backBytes := unsafe.Slice((*byte)(back), total)
	targetBytes := unsafe.Slice((*byte)(target), total)
	for i := range srcBytes {
		srcBytes[i] = byte(i*7 + 3)
		backBytes[i] = 0
		targetBytes[i] = 0
	}
	registerAll(a, src)
	registerAll(a, back)
	registerAll(b, target)

	off := func(p unsafe.Pointer, i int) unsafe.Pointer { return unsafe.Add(p, i*chunkSize) }
	parallel(func(i int) error { return transfer(a, peer, C.OPCODE_WRITE, off(src, i), off(target, i)) })
	for i := range srcBytes {
		if targetBytes[i] != srcBytes[i] {
			fail("WRITE: byte %d is %d, want %d", i, targetBytes[i], srcBytes[i])
		}
	}
	parallel(func(i int) error { return transfer(a, peer, C.OPCODE_READ, off(back, i), off(target, i)) })
	for i := range srcBytes {
		if backBytes[i] != srcBytes[i] {
			fail("READ: byte %d is %d, want %d", i, backBytes[i], srcBytes[i])
		}
	}

	if ret := C.syncSegmentCache(a); ret < 0 {
		fail("syncSegmentCache = %d", int(ret))
	}
	name := C.CString(peer)
	seg := C.openSegment(a, name)
	C.free(unsafe.Pointer(name))
	if seg < 0 {
		fail("openSegment after sync = %d", int(seg))
	}
	if ret := C.closeSegment(a, seg); ret < 0 {
		fail("closeSegment = %d", int(ret))
	}

	unregisterAll(a, src)
	unregisterAll(a, back)
	unregisterAll(b, target)
	C.destroyTransferEngine(a)
	C.destroyTransferEngine(b)
	C.free(src)
	C.free(back)
	C.free(target)
	fmt.Printf("go classic: %d chunks written and read back over TCP, ok\n", chunks)
}
