/* Shared by the C kernels that take integer arrays from Python (`_counting.looked_up`, `_encoding.codes`). */
#ifndef DPRELEASE_SIGNED_BUFFER_H
#define DPRELEASE_SIGNED_BUFFER_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A C-contiguous buffer of `object` whose items are signed integers of `itemsize` bytes (0: of 1, 2, 4 bytes, or 8
 * when `widest` is 8), aligned to their size; 0 with ValueError(`message`) otherwise (a buffer of other items read
 * by its byte length would be read as other values). */
static int open_signed_buffer(PyObject *object, Py_buffer *view, int writable, Py_ssize_t itemsize, Py_ssize_t widest,
                              const char *message)
{
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return 0;
    const char *format = view->format == NULL ? "B" : view->format;
    if (format[0] != '\0' && strchr("@=<>!", format[0]) != NULL)
        format++;
    Py_ssize_t size = view->itemsize;
    if (strlen(format) != 1 || strchr("bhilq", format[0]) == NULL ||
        (itemsize ? size != itemsize : size != 1 && size != 2 && size != 4 && size != widest) ||
        (uintptr_t)view->buf % (uintptr_t)size != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, message);
        return 0;
    }
    return 1;
}

#endif
