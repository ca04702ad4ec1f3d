/* dlsym for x86-64: ask distmem_dlsym_hook first; if it declines, tail-jump to the C library's
 * dlsym with the original arguments and return address, so that RTLD_NEXT / RTLD_DEFAULT lookups
 * are resolved relative to the real caller, not to this library. */

    .text
    .globl  dlsym
    .type   dlsym, @function
    .hidden distmem_dlsym_hook
    .hidden distmem_real_dlsym
    .p2align 4
dlsym:
    .cfi_startproc
    endbr64
    pushq   %rdi
    .cfi_adjust_cfa_offset 8
    pushq   %rsi
    .cfi_adjust_cfa_offset 8
    subq    $8, %rsp                 /* 16-byte alignment at the call */
    .cfi_adjust_cfa_offset 8
    call    distmem_dlsym_hook
    addq    $8, %rsp
    .cfi_adjust_cfa_offset -8
    popq    %rsi
    .cfi_adjust_cfa_offset -8
    popq    %rdi
    .cfi_adjust_cfa_offset -8
    testq   %rax, %rax
    jne     1f
    jmpq    *distmem_real_dlsym(%rip) /* set by the hook before it returns */
1:
    ret
    .cfi_endproc
    .size   dlsym, .-dlsym

    .section .note.GNU-stack, "", @progbits
